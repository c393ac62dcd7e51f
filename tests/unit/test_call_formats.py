"""Forced calls in the markup of the models whose parsers mlx-lm added last (FunctionGemma,
LongCat, MiniCPM5, Muse Spark, Kimi K3, Laguna): each call is written here as its model
writes it (a small renderer per format, after the published renderings, independent of the
grammars), the format's grammar admits it whole and then only the turn's end, and mlx-lm's
own parser reads the generated name and arguments back; what the grammar must refuse (an
unknown tool, a value of the wrong type, a missing argument, text the parser misreads) it
refuses; and a tokenizer carrying a model's markers gets its format from mlx-lm's loader."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest
from mlx_lm.tokenizer_utils import load
from transformers import PreTrainedTokenizerFast

from mlx_cache_server.serving import call_formats, call_markup
from mlx_cache_server.serving.structured import checked
from tests.tiny_model import build_tokenizer, write_tokenizer
from tests.unit.test_call_markup import accepts
from tests.unit.test_prompted_tools import Driver

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"}},
    "required": ["city", "unit"]}}}  # fmt: skip
SETTINGS = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {
        "level": {"type": "number"}, "on": {"type": "boolean"},
        "Mode": {"type": "string", "enum": ["fast", "slow"]}, "note": {"type": "string"}},
    "required": ["level", "on"]}}}  # fmt: skip
PLAN = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {
        "title": {"type": "string"},
        "where": {"type": "object", "properties": {"lon": {"type": "number"},
                  "lat": {"type": "number"}}, "required": ["lon", "lat"]},
        "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "where"]}}}  # fmt: skip
FLAT = [WEATHER, SETTINGS]


def _gemma(name: str, arguments: dict) -> str:
    """FunctionGemma's template: keys sorted as `dictsort` sorts them, strings between
    `<escape>` tokens, booleans as JSON, numbers as Python prints them."""

    def value(v):
        if isinstance(v, str):
            return f"<escape>{v}<escape>"
        return json.dumps(v) if isinstance(v, bool) else str(v)

    pairs = sorted(arguments.items(), key=lambda kv: kv[0].lower())
    body = ",".join(f"{k}:{value(v)}" for k, v in pairs)
    return f"call:{name}{{{body}}}<end_function_call>"


def _longcat(name: str, arguments: dict) -> str:
    args = "".join(
        f"<longcat_arg_key>{k}</longcat_arg_key>\n<longcat_arg_value>"
        f"{v if isinstance(v, str) else json.dumps(v)}</longcat_arg_value>\n"
        for k, v in arguments.items()
    )
    return f"{name}\n{args}</longcat_tool_call>"


def _minicpm(name: str, arguments: dict) -> str:
    args = "".join(
        f'<param name="{k}">{v if isinstance(v, str) else json.dumps(v)}</param>'
        for k, v in arguments.items()
    )
    return f'"{name}">{args}</function>'


def _muse(name: str, arguments: dict) -> str:
    """Muse's `render_atem`: scalars bare (numbers as Python prints them), booleans,
    objects and lists as JSON."""

    def value(v):
        return json.dumps(v) if isinstance(v, bool | dict | list) else str(v)

    args = "".join(
        f'<atem:parameter name="{k}">{value(v)}</atem:parameter>\n' for k, v in arguments.items()
    )
    return (
        f'{name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n{args}'
        "</atem:invoke>\n</atem:function_calls>"
    )


def _xtml(name: str, arguments: dict) -> str:
    """Kimi K3's encoder: one argument per key, typed by its JSON value."""

    def typed(v):
        if isinstance(v, str):
            return "string", v
        kind = {bool: "boolean", dict: "object", list: "array"}.get(type(v), "number")
        return kind, json.dumps(v)

    args = ""
    for k, v in arguments.items():
        kind, text = typed(v)
        args += f'<|open|>argument key="{k}" type="{kind}"<|sep|>{text}<|close|>argument<|sep|>'
    return (
        f'<|open|>call tool="{name}" index="1"<|sep|>{args}'
        "<|close|>call<|sep|><|close|>tools<|sep|>"
    )


RENDER = {
    "function_gemma": _gemma, "longcat": _longcat, "minicpm5": _minicpm,
    "muse_spark": _muse, "kimi_k3": _xtml,
}  # fmt: skip
NESTING = ("muse_spark", "kimi_k3")  # the parsers that read objects and lists
CALLS = [
    ("get_weather", {"city": "Paris", "unit": "c"}),
    ("get_weather", {"city": "New York, NY", "unit": "f", "days": -3}),
    ("set_mode", {"level": 1.5, "on": True, "Mode": "slow", "note": "a: b, c"}),
    ("set_mode", {"level": 0, "on": False, "note": "x"}),
]
NESTED = [
    ("plan", {"title": "trip", "where": {"lon": 2.25, "lat": -0.5}, "tags": ["x", "y z"]}),
    ("plan", {"title": "t", "where": {"lon": 1, "lat": 0.125}}),
]
CASES = [(f, *call, FLAT) for f in RENDER for call in CALLS] + [
    (f, *call, [PLAN, WEATHER]) for f in NESTING for call in NESTED
]


@pytest.fixture(scope="module")
def tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=0)


def grammar(parser: str, tools: list[dict]) -> str:
    form = call_formats.FORMATS[parser]
    assert form.supports(tools)
    return checked(form.grammar(tools), "tools", strict=False)


def parsed(parser: str, text: str, tools: list[dict]) -> tuple[str, dict]:
    """The one call mlx-lm's parser reads from a forced call's text (its end stripped)."""
    form = call_formats.FORMATS[parser]
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    call = module.parse_tool_call(text.removesuffix(form.end), tools)
    call = call if isinstance(call, dict) else call[0] if len(call) == 1 else call
    return call["name"], call["arguments"]


@pytest.mark.parametrize(("parser", "name", "arguments", "tools"), CASES)
def test_the_grammar_admits_the_call_and_the_parser_reads_it_back(
    tokenizer, parser, name, arguments, tools
):
    text = RENDER[parser](name, arguments)
    run = Driver(tokenizer, grammar(parser, tools))
    run.write(text)
    assert run.allowed == {0}, text  # the call is whole: only the turn's end
    assert parsed(parser, text, tools) == (name, arguments)


WRONG = [
    ("get_wether", {"city": "Paris", "unit": "c"}),  # no such tool
    ("get_weather", {"city": "Paris", "unit": "k"}),  # not in the enum
    ("get_weather", {"city": "Paris", "unit": "c", "days": "three"}),  # not an integer
    ("get_weather", {"city": "Paris", "unit": "c", "days": 1.5}),  # not an integer
    ("get_weather", {"unit": "c"}),  # the city is required
    ("set_mode", {"level": "high", "on": True}),  # not a number
    ("set_mode", {"level": 1, "on": "yes"}),  # not a boolean
    ("set_mode", {"level": 1, "on": True, "colour": "red"}),  # no such argument
]
# Text a parser would misread, or a template would not write as is.
MISREAD = {
    "function_gemma": ("get_weather", {"city": "a}b", "unit": "c"}),  # ends the call early
    "longcat": ("get_weather", {"city": " Paris", "unit": "c"}),  # the parser strips it
    "minicpm5": ("get_weather", {"city": "A & B", "unit": "c"}),  # the template's CDATA
    "muse_spark": ("get_weather", {"city": "123", "unit": "c"}),  # read back as a number
    "kimi_k3": ("get_weather", {"city": "a<b", "unit": "c"}),  # a marker's first character
}


@pytest.mark.parametrize("parser", RENDER)
@pytest.mark.parametrize(("name", "arguments"), WRONG)
def test_the_grammar_refuses_what_the_schema_refuses(tokenizer, parser, name, arguments):
    assert not accepts(tokenizer, grammar(parser, FLAT), RENDER[parser](name, arguments))


@pytest.mark.parametrize("parser", RENDER)
def test_the_grammar_refuses_a_string_its_parser_or_template_would_change(tokenizer, parser):
    text = RENDER[parser](*MISREAD[parser])
    assert not accepts(tokenizer, grammar(parser, FLAT), text)


def test_muse_writes_strings_bare_but_none_that_reads_as_json(tokenizer):
    g = grammar("muse_spark", FLAT)
    for city in ("true", "null", "-1.5e3", "NaN", '"quoted"', "[1]", "{}"):
        assert not accepts(tokenizer, g, _muse("get_weather", {"city": city, "unit": "c"}))
    for city in ("trueish", "1st street", "nullable", "a [1]"):
        text = _muse("get_weather", {"city": city, "unit": "c"})
        assert accepts(tokenizer, g, text)
        assert parsed("muse_spark", text, FLAT)[1]["city"] == city


def named(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}  # fmt: skip


@pytest.mark.parametrize(
    ("parser", "tool"),
    [
        ("function_gemma", PLAN),  # its parser reads flat arguments only
        ("longcat", PLAN),
        ("minicpm5", PLAN),
        ("function_gemma", named("get.weather", {"city": {"type": "string"}}, ["city"])),
        ("function_gemma", named("f", {"u": {"enum": ["a}"]}}, ["u"])),
        ("longcat", named("now", {"zone": {"type": "string"}}, [])),  # may have no argument
        ("longcat", named("now", {}, [])),
        ("muse_spark", named("f", {"u": {"enum": ["1", "a"]}}, ["u"])),  # "1" reads as 1
        ("kimi_k3", named("f", {"u": {"type": "string", "pattern": "^a"}}, ["u"])),
    ],
    ids=lambda v: v if isinstance(v, str) else v["function"]["name"],
)
def test_what_the_markup_cannot_hold_keeps_the_bare_json_call(parser, tool):
    assert not call_formats.FORMATS[parser].supports([tool])


# Minimal templates carrying the markers mlx-lm's loader picks each parser by.
TEMPLATES = {
    "function_gemma": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{{ '<start_function_call>call:' }}",
    "longcat": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{{ '<longcat_tool_call>' + '<longcat_arg_key>' }}",
    "minicpm5": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{{ '<function name=\"' + '<param name=\"' }}",
    "muse_spark": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{{ '<atem:function_calls>' }}",
    "kimi_k3": "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # by its vocabulary
}
MARKERS = {
    "function_gemma": ["<start_function_call>", "<end_function_call>", "<escape>"],
    "longcat": ["<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
                "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>"],
    "minicpm5": [],
    "muse_spark": ["<|start|>", "<|message|>", "<|eom|>"],
    "kimi_k3": ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"],
}  # fmt: skip
EOS = "<|im_end|>"


def loaded(path: Path, special: list[str], template: str, **config: str):
    """mlx-lm's tokenizer of a model with `special` tokens under `template`."""
    write_tokenizer(path, [EOS, *special], template, {"eos_token": EOS, **config})
    return load(path)


@pytest.mark.parametrize("parser", TEMPLATES)
def test_the_model_gets_its_format_and_its_grammar_takes_its_tokens(tmp_path, parser):
    """mlx-lm's loader picks the parser from the markers; the format follows it, and its
    grammar, spelled in the model's tokens, takes a call written with them."""
    wrapper = loaded(tmp_path, MARKERS[parser], TEMPLATES[parser])
    assert wrapper.tool_parser.__module__ == f"mlx_lm.tool_parsers.{parser}"
    form = call_formats.call_format(wrapper)
    assert form is call_formats.FORMATS[parser]
    hf = wrapper._tokenizer
    lt = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=hf.convert_tokens_to_ids(EOS))
    marker = call_markup.token_marker(wrapper)
    assert all(marker(m).startswith("<[") for m in MARKERS[parser])  # each its own token
    run = Driver((hf, lt), checked(form.grammar(FLAT, marker), "tools", strict=False))
    name, arguments = CALLS[1]
    text = RENDER[parser](name, arguments)
    run.write(text)
    assert run.allowed == {hf.convert_tokens_to_ids(EOS)}
    assert parsed(parser, text, FLAT) == (name, arguments)


def test_a_longcat_template_that_writes_json_calls_keeps_the_bare_json_call(tmp_path):
    template = "{{ '<longcat_tool_call>' + (calls | tojson) + '</longcat_tool_call>' }}"
    wrapper = loaded(tmp_path, MARKERS["longcat"], template)
    assert wrapper.tool_parser.__module__ == "mlx_lm.tool_parsers.longcat"
    assert call_formats.call_format(wrapper) is None


def test_laguna_named_by_its_config_gets_glm47s_markup(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    wrapper = loaded(tmp_path, [], template, tool_parser_type="laguna")
    laguna = importlib.import_module("mlx_lm.tool_parsers.laguna")
    assert wrapper.tool_parser is laguna.parse_tool_call
    assert call_formats.call_format(wrapper) is call_markup.GLM47


@pytest.mark.parametrize("parser", RENDER)
def test_the_server_forces_and_reads_a_call_in_the_models_markup(tokenizer, parser):
    """plan_tools picks the format by the parser, the prompt ends with its prefix, and the
    reply reads the call with the model's parser."""
    from mlx_cache_server.serving.chat import Reply
    from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
    from mlx_cache_server.serving.tools import plan_tools

    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    wrapped = SimpleNamespace(
        has_tool_calling=True, tool_parser=module.parse_tool_call, chat_template=TEMPLATES[parser],
        tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end,
        encode=tokenizer[0].encode,
    )  # fmt: skip
    engine = SimpleNamespace(tokenizer=wrapped)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    req = ChatCompletionRequest(model="m", messages=user, tools=FLAT, tool_choice="required")
    plan = plan_tools(req, engine)
    assert plan.form is call_formats.FORMATS[parser] and plan.prefix == plan.form.prefix
    name, arguments = CALLS[2]
    text = RENDER[parser](name, arguments)
    Driver(tokenizer, plan.grammar).write(text)
    content, calls = Reply(engine, req, plan).whole(text)
    assert not content and calls[0].function.name == name
    assert json.loads(calls[0].function.arguments) == arguments
