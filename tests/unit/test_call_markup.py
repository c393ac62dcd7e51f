"""Forced calls in each model's own markup, on the real chat templates: the grammar for a
forced `get_weather` call admits exactly the text the template writes back for that call
(driven token by token over the tiny byte-level tokenizer), the turn's end after it, and
mlx-lm's own parser reads the call back from it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from mlx_cache_server.serving import call_formats, call_markup
from mlx_cache_server.serving.structured import checked
from mlx_cache_server.serving.template import templated_history
from tests.real_templates import REAL_TEMPLATES
from tests.tiny_model import build_tokenizer
from tests.unit.test_prompted_tools import Driver

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
    "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"]}}}  # fmt: skip
OTHER = {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}, "exact": {"type": "boolean"}},
    "required": ["zone"]}}}  # fmt: skip
ARGUMENTS = {"city": "Paris", "unit": "c"}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def parser_of(path: Path) -> str | None:
    """The parser mlx-lm infers for the real model (LFM2.5's from its vocabulary)."""
    return REAL_TEMPLATES[path.name].parser


def server_history(path: Path, messages: list[dict]) -> list[dict]:
    """The messages as the server hands them to the template (`templated_history`: for
    LFM2.5, whose template drops calls, the calls written into the content)."""
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{parser_of(path)}")
    tokenizer = SimpleNamespace(
        chat_template=path.read_text(), has_tool_calling=True,
        tool_parser=parser.parse_tool_call, tool_call_start=parser.tool_call_start,
        tool_call_end=parser.tool_call_end,
    )  # fmt: skip
    return templated_history(tokenizer, messages)


FORMATTED = [p for p in sorted(TEMPLATES.glob("*.jinja")) if parser_of(p) in call_formats.FORMATS]


@pytest.fixture(scope="module")
def tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=0)


def renderer(path: Path, tools: list[dict]):
    def render(messages: list[dict], generation_prompt: bool) -> str:
        out, _ = render_jinja_template(
            [messages], tools=tools, chat_template=path.read_text(),
            add_generation_prompt=generation_prompt, bos_token="<s>", eos_token="</s>",
        )  # fmt: skip
        return out[0]

    return render


def call_turn(name: str, arguments: dict) -> list[dict]:
    call = {"id": "abcdefghi", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcdefghi", "name": name, "content": "sunny"},
    ]


def generated(path: Path, tools: list[dict], name: str, arguments: dict):
    """The forced call's prompt, and the text after it the template writes back for the
    call: what the model must generate for the next turn to reuse it."""
    form = call_formats.FORMATS[parser_of(path)]
    render = renderer(path, tools)
    prompt = call_markup.prompt_text(render, USER, tools, form)
    if prompt is None:  # the template writes no call: the generation prompt, as the server
        prompt = render(USER, True) + form.prefix
    after = render(server_history(path, USER + call_turn(name, arguments)), False)
    assert after.startswith(prompt), (prompt[-80:], after[len(prompt) - 80 :])
    rest = after[len(prompt) :]
    at = rest.index(form.end or "</s>")  # no end marker: the turn's end (the eos) ends it
    if form.writes_end:
        return form, prompt, rest[: at + len(form.end)]
    return form, prompt, rest[:at].removesuffix("\n")


@pytest.mark.parametrize("path", FORMATTED, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    ("name", "arguments"),
    [("get_weather", ARGUMENTS), ("get_time", {"zone": -3, "exact": True}),
     ("get_time", {"zone": 12})],
)  # fmt: skip
def test_a_forced_call_is_the_markup_the_template_writes_back(tokenizer, path, name, arguments):
    tools = [WEATHER, OTHER]
    form, _, text = generated(path, tools, name, arguments)
    grammar = checked(form.grammar(tools), "tools", strict=False)
    run = Driver(tokenizer, grammar)
    run.write(text)
    assert run.allowed == {0}, text  # the call is whole: only the turn's end
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_of(path)}")
    parse = getattr(form, "parse", None) or module.parse_tool_call  # the format's own reader
    body = text.removesuffix(form.end) if form.writes_end else text
    call = parse(body, tools)
    call = call[0] if isinstance(call, list) else call
    assert (call["name"], call["arguments"]) == (name, arguments)


@pytest.mark.parametrize("path", FORMATTED, ids=lambda p: p.stem)
def test_a_forced_call_holds_its_arguments_to_the_schema(tokenizer, path):
    form, _, text = generated(path, [WEATHER], "get_weather", ARGUMENTS)
    run = Driver(tokenizer, checked(form.grammar([WEATHER]), "tools", strict=False))
    head = text[: text.index("Paris")]
    run.write(head)
    run.write("Paris")
    rest = text[len(head) + len("Paris") :]
    at = rest.index('"c"' if '"c"' in rest else "c")
    run.write(rest[:at] + ('"' if rest[at] == '"' else ""))
    assert run.allows("c") and run.allows("f") and not run.allows("k")  # the enum


@pytest.mark.parametrize("path", FORMATTED, ids=lambda p: p.stem)
def test_the_prompt_ends_where_the_template_writes_the_call_back(path):
    """Where the generation prompt opens a thinking block the template does not write
    back before a call, the forced call's prompt is the write-back, not that block."""
    form, prompt, _ = generated(path, [WEATHER], "get_weather", ARGUMENTS)
    assert prompt.endswith(form.prefix)


def test_the_server_forces_and_reads_a_call_in_qwen3_coder_markup(tokenizer):
    """plan_tools picks the model's format by its parser, and the reply reads the call."""
    from mlx_lm.tool_parsers import qwen3_coder

    from mlx_cache_server.serving.chat import Reply
    from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
    from mlx_cache_server.serving.tools import plan_tools

    hf = tokenizer[0]
    wrapped = SimpleNamespace(
        has_tool_calling=True, tool_parser=qwen3_coder.parse_tool_call,
        tool_call_start="<tool_call>", tool_call_end="</tool_call>", encode=hf.encode,
    )  # fmt: skip
    engine = SimpleNamespace(tokenizer=wrapped)
    req = ChatCompletionRequest(model="m", messages=USER, tools=[WEATHER], tool_choice="required")
    plan = plan_tools(req, engine)
    assert plan.prefix == "<tool_call>\n" and plan.form is call_markup.QWEN3_CODER
    text = (
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
    )
    Driver(tokenizer, plan.grammar).write(text)
    content, calls = Reply(engine, req, plan).whole(text)
    assert content is None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == ARGUMENTS
    reply = Reply(engine, req, plan)
    assert reply.feed(text) == ("", [])
    content, deltas = reply.finish()
    assert content == "" and json.loads(deltas[0].function.arguments) == ARGUMENTS


MISTRAL = TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja"
MISTRAL_CALL = 'get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "c"}'


def mistral_engine(hf, template: str = MISTRAL.read_text()) -> SimpleNamespace:
    from mlx_lm.tool_parsers import mistral

    wrapped = SimpleNamespace(
        has_tool_calling=True, tool_parser=mistral.parse_tool_call, chat_template=template,
        tool_call_start="[TOOL_CALLS]", tool_call_end="", encode=hf.encode,
    )  # fmt: skip
    return SimpleNamespace(tokenizer=wrapped)


def test_mistral_writes_the_calls_id_and_the_grammar_takes_nine_alphanumerics(tokenizer):
    _, prompt, text = generated(MISTRAL, [WEATHER], "get_weather", ARGUMENTS)
    assert prompt.endswith("[/INST][TOOL_CALLS]")
    assert text == 'get_weather[CALL_ID]abcdefghi[ARGS]{"city": "Paris", "unit": "c"}'
    grammar = checked(call_markup.MistralCalls().grammar([WEATHER]), "tools", strict=False)
    run = Driver(tokenizer, grammar)
    run.write("get_weather[CALL_ID]a1B2c3D4")
    assert run.allows("e") and not run.allows("_") and not run.allows("[")
    run.write("e")
    assert not run.allows("f") and run.allows("[")  # nine, no more


def test_mistral_calls_are_read_with_their_ids_where_mlx_lm_takes_the_id_for_the_name():
    from mlx_lm.tool_parsers import mistral

    theirs = mistral.parse_tool_call(MISTRAL_CALL)
    assert theirs["name"] == "a1B2c3D4e"  # why the format reads its calls itself
    form = call_markup.MistralCalls()
    assert form.parse(MISTRAL_CALL) == [{"name": "get_weather", "arguments": ARGUMENTS,
                                         "id": "a1B2c3D4e"}]  # fmt: skip
    two = form.parse(MISTRAL_CALL + '[TOOL_CALLS]get_time[CALL_ID]Z9y8X7w6V[ARGS]{"zone": 1}')
    assert [(c["name"], c["id"]) for c in two] == [("get_weather", "a1B2c3D4e"),
                                                  ("get_time", "Z9y8X7w6V")]  # fmt: skip
    older = form.parse('[{"name": "get_time", "arguments": {"zone": 1}, "id": "Z9y8X7w6V"}]')
    assert older == [{"name": "get_time", "arguments": {"zone": 1}, "id": "Z9y8X7w6V"}]
    with pytest.raises(ValueError):
        form.parse('get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Par')  # cut off


def test_only_a_mistral_template_that_writes_call_ids_gets_the_markup(tokenizer):
    engine = mistral_engine(tokenizer[0])
    assert isinstance(call_formats.call_format(engine.tokenizer), call_markup.MistralCalls)
    older = mistral_engine(tokenizer[0], "{{ '[TOOL_CALLS]' + (calls | tojson) }}")
    assert call_formats.call_format(older.tokenizer) is None


def test_the_server_gives_a_forced_mistral_call_the_id_it_generated(tokenizer):
    """The client's id for the call is built on the generated one, and the history the
    client sends back with it renders the call as it was generated."""
    from mlx_cache_server.serving.call_history import short_id, with_short_ids
    from mlx_cache_server.serving.chat import Reply
    from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
    from mlx_cache_server.serving.tools import ToolCallText, plan_tools

    engine = mistral_engine(tokenizer[0])
    req = ChatCompletionRequest(model="m", messages=USER, tools=[WEATHER], tool_choice="required")
    plan = plan_tools(req, engine)
    assert plan.prefix == "[TOOL_CALLS]" and isinstance(plan.form, call_markup.MistralCalls)
    Driver(tokenizer, plan.grammar).write(MISTRAL_CALL)
    content, calls = Reply(engine, req, plan).whole(MISTRAL_CALL)
    assert content is None and calls[0].id == "call_a1B2c3D4e"
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == ARGUMENTS
    assert short_id(calls[0].id) == short_id("toolu_a1B2c3D4e") == "a1B2c3D4e"
    streamed = Reply(engine, req, plan)
    assert streamed.feed(MISTRAL_CALL) == ("", [])
    content, deltas = streamed.finish()
    assert content == "" and deltas[0].id == "call_a1B2c3D4e"
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
         "arguments": ARGUMENTS}}]}]  # fmt: skip
    assert MISTRAL_CALL + "</s>" in renderer(MISTRAL, [WEATHER])(with_short_ids(history), False)
    # A call the model makes unforced is read the same way.
    text = ToolCallText(engine, [WEATHER])
    assert text.feed("Sure. [TOOL_CALLS]" + MISTRAL_CALL) == ("Sure. ", [])
    content, calls = text.finish()
    assert content == "" and calls[0].id == "call_a1B2c3D4e"
    assert calls[0].function.name == "get_weather"


PLAN = {"type": "function", "function": {"name": "plan", "description": "Plan", "parameters": {
    "type": "object", "properties": {
        "title": {"type": "string"}, "Zeta": {"type": "number"}, "alpha": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lon": {"type": "number"},
                  "Lat": {"type": "number"}}, "required": ["lon", "Lat"]},
        "on": {"type": "boolean"}},
    "required": ["title"]}}}  # fmt: skip
OWN_SYNTAX = [p for p in FORMATTED if parser_of(p) in ("gemma4", "pythonic")]


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar admits `text` whole, then only the turn's end."""
    run = Driver(tokenizer, grammar)
    for token in run.hf.encode(text, add_special_tokens=False):
        if token not in run.allowed:
            return False
        run.tokens.append(token)
        run.allowed = run._step()
    return run.allowed == {0}


@pytest.mark.parametrize("path", OWN_SYNTAX, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "arguments",
    [{"title": 'a "b" {c}: d\\e, f=1', "Zeta": 1.5, "alpha": -3, "tags": ["x", "y z"],
      "where": {"lon": 2.25, "Lat": -0.5}, "on": False},
     {"title": ""}, {"title": "t", "Zeta": 7, "on": True}, {"title": "t", "Zeta": 0.0001}],
)  # fmt: skip
def test_values_are_generated_as_the_write_back_prints_them(tokenizer, path, arguments):
    """Gemma 4: `<|"|>` strings, keys sorted at every level (`Zeta` among lower case as
    `dictsort` sorts it), Python's numbers; pythonic: `json.dumps`'s values. Either way
    the grammar admits the write-back whole and the model's parser reads it back."""
    form, _, text = generated(path, [PLAN, OTHER], "plan", arguments)
    assert accepts(tokenizer, checked(form.grammar([PLAN, OTHER]), "tools", strict=False), text)
    parse = importlib.import_module(f"mlx_lm.tool_parsers.{parser_of(path)}").parse_tool_call
    assert parse(text.removesuffix(form.end), [PLAN]) == {"name": "plan", "arguments": arguments}


@pytest.mark.parametrize("path", OWN_SYNTAX, ids=lambda p: p.stem)
@pytest.mark.parametrize(("zeta", "written"), [(1.5, "1.50"), (100000.0, "1e5"), (0.0, "-0"),
                                               (1e-05, "0.00001"), (2.0, "2.00")])  # fmt: skip
def test_a_number_is_written_only_as_python_prints_it(tokenizer, path, zeta, written):
    """A number the template would print otherwise next turn is refused: its reuse
    would stop there."""
    form, _, text = generated(path, [PLAN], "plan", {"title": "t", "Zeta": zeta})
    printed = "1e-05" if zeta == 1e-05 else repr(zeta)
    assert printed in text and written not in text
    grammar = checked(form.grammar([PLAN]), "tools", strict=False)
    assert not accepts(tokenizer, grammar, text.replace(printed, written))
    if zeta != 1e-05:  # an exponent Python writes is outside the generated range
        assert accepts(tokenizer, grammar, text)


LOOSE = {"type": "function", "function": {"name": "loose", "description": "Loose", "parameters": {
    "type": "object", "properties": {
        "any": {}, "map": {"type": "object"}, "either": {"anyOf": [{"type": "integer"},
        {"type": "string"}]}, "maybe": {"type": ["string", "null"]}, "level": {"enum": [1, 2]},
        "fixed": {"const": {"b": [True], "a": "x"}}},
    "required": ["any", "map", "either", "maybe", "level", "fixed"]}}}  # fmt: skip


@pytest.mark.parametrize("path", OWN_SYNTAX, ids=lambda p: p.stem)
def test_values_whose_schema_leaves_their_shape_open(tokenizer, path):
    """Untyped values, free-form maps (keys as the template sorts them), unions, enums
    and constants of any JSON type are written as the template writes them back."""
    arguments = {
        "any": [1, "s", {"k": False}], "map": {"a": 1, "b": {"c": "d"}}, "either": "7",
        "maybe": "m", "level": 2, "fixed": {"b": [True], "a": "x"},
    }  # fmt: skip
    form, _, text = generated(path, [LOOSE], "loose", arguments)
    assert accepts(tokenizer, checked(form.grammar([LOOSE]), "tools", strict=False), text)
    parse = importlib.import_module(f"mlx_lm.tool_parsers.{parser_of(path)}").parse_tool_call
    assert parse(text.removesuffix(form.end), [LOOSE])["arguments"] == arguments


def qwen3_coder_engine(hf) -> SimpleNamespace:
    from mlx_lm.tool_parsers import qwen3_coder

    wrapped = SimpleNamespace(
        has_tool_calling=True, tool_parser=qwen3_coder.parse_tool_call,
        tool_call_start="<tool_call>", tool_call_end="</tool_call>", encode=hf.encode,
    )  # fmt: skip
    return SimpleNamespace(tokenizer=wrapped)


def weather_with(prop: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": prop}, "required": ["city"]}}}  # fmt: skip


@pytest.mark.parametrize(
    "prop",
    [
        {"anyOf": [{"type": "string"}, {"type": "null"}]},  # pydantic's Optional[str]
        {"type": "integer", "enum": [1, 2, 4]},
        {"type": "integer", "minimum": 1, "maximum": 7},
        {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        {"type": "string", "maxLength": 3},
        {"$ref": "#/$defs/City"},
        {"type": "object", "properties": {"name": {"type": "string"}}},
    ],
    ids=["optional", "integer enum", "bounds", "pattern", "length", "ref", "object"],
)
def test_what_a_markup_cannot_hold_is_forced_as_json_that_holds_it(tokenizer, prop):
    """XML parameters hold a value's type and a string enum, no more: a tool with other
    keywords gets the bare JSON call, which enforces them, and reads back as written."""
    from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
    from mlx_cache_server.serving.tools import plan_tools

    tool = weather_with(prop)
    if "$ref" in prop:
        tool["function"]["parameters"]["$defs"] = {"City": {"type": "string"}}
    req = ChatCompletionRequest(model="m", messages=USER, tools=[tool], tool_choice="required")
    plan = plan_tools(req, qwen3_coder_engine(tokenizer[0]))
    assert plan.form is None and plan.grammar is not None and plan.prefix == ""


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": [{"a": 1}]},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": [{"x": 1}]},
    ],
    ids=["properties list", "required objects"],
)
def test_malformed_parameters_are_the_clients_400_not_a_500(tokenizer, parameters):
    from mlx_cache_server.serving.api_errors import APIError
    from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
    from mlx_cache_server.serving.tools import plan_tools

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    req = ChatCompletionRequest(model="m", messages=USER, tools=[tool], tool_choice="required")
    with pytest.raises(APIError) as refused:
        plan_tools(req, qwen3_coder_engine(tokenizer[0]))
    assert refused.value.status == 400
