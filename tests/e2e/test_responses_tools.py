"""The Responses API's tool surface as Codex and the Agents SDK use it, through the `openai`
SDK: namespaces, the provider's own tools and their items, allowed_tools, on a model whose
template knows no tools."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {"type": "function", "name": "close_agent", "description": "Close an agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "id": {"type": "string", "maxLength": 6}}, "required": ["id"],
             "additionalProperties": False}},
    ],
}  # fmt: skip
SHELL = {"type": "function", "name": "exec_command", "description": "Run a command.",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 8}},
                        "required": ["cmd"], "additionalProperties": False}}  # fmt: skip
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {"type": "shell"},
    {"type": "apply_patch"},
    {"type": "tool_search"},
    {"type": "image_generation"},
]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_a_namespaced_call_comes_back_apart_and_goes_back_in_as_codex_sends_it(oai):
    r = oai.responses.create(
        model="tiny", input="Close agent a1.", tools=[AGENTS, SHELL, *HOSTED],
        tool_choice="required", temperature=0, max_output_tokens=200,
    )  # fmt: skip
    (call,) = [o for o in r.output if o.type == "function_call"]
    raw = call.model_dump()
    assert raw["name"] in ("close_agent", "exec_command")
    if raw["name"] == "close_agent":
        assert raw["namespace"] == "multi_agent_v1"
    else:
        assert "namespace" not in raw or raw["namespace"] is None
    json.loads(call.arguments)
    seen = r.usage.input_tokens + r.usage.output_tokens
    follow = oai.responses.create(
        model="tiny", tools=[AGENTS, SHELL, *HOSTED], temperature=0, max_output_tokens=8,
        input=[
            {"role": "user", "content": "Close agent a1."},
            {k: v for k, v in raw.items() if k in ("type", "call_id", "name", "namespace",
                                                   "arguments") and v is not None},
            {"type": "function_call_output", "call_id": call.call_id, "output": "closed"},
        ],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete")
    # The call re-rendered as generated: the whole previous turn but its end came cached.
    assert follow.usage.input_tokens_details.cached_tokens >= seen - 2


def test_a_forced_namespaced_function_is_named_with_its_namespace(oai):
    r = oai.responses.create(
        model="tiny", input="Close agent a1.", tools=[AGENTS, SHELL], temperature=0,
        tool_choice={"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
        max_output_tokens=200,
    )  # fmt: skip
    (call,) = [o.model_dump() for o in r.output if o.type == "function_call"]
    assert (call["name"], call["namespace"]) == ("close_agent", "multi_agent_v1")


def test_allowed_tools_limits_what_is_called(oai):
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "exec_command"}]}  # fmt: skip
    r = oai.responses.create(
        model="tiny", input="List files.", tools=[AGENTS, SHELL], tool_choice=choice,
        temperature=0, max_output_tokens=200,
    )  # fmt: skip
    assert [o.name for o in r.output if o.type == "function_call"] == ["exec_command"]


@pytest.fixture(scope="module")
def lark_check():
    """Whether text is (a prefix of) a sentence of a Lark grammar, by llguidance's own Lark
    parser, not the regex the server holds the call to."""
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_model import build_tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    tokenizer = llguidance.hf.from_tokenizer(hf)

    def check(grammar: str, text: str) -> tuple[bool, bool]:
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar))
        ids = hf.encode(text)
        return matcher.try_consume_tokens(ids) == len(ids), matcher.is_accepting()

    return check


@pytest.mark.parametrize("ask", ["Fix the bug.", "Rename x to y in a.py.", "Add a README."])
def test_a_forced_apply_patch_follows_its_lark_grammar(oai, lark_check, ask):
    from tests.unit.test_lark_regex import APPLY_PATCH

    grammar = {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}
    patch = {"type": "custom", "name": "apply_patch", "description": "Edit.", "format": grammar}
    r = oai.responses.create(
        model="tiny", input=ask, tools=[SHELL, patch], temperature=1.0, max_output_tokens=160,
        tool_choice={"type": "custom", "name": "apply_patch"},
    )  # fmt: skip
    patch_text = _forced_input(r)
    assert patch_text.startswith("*** Begin Patch\n*** ")
    valid, whole = lark_check(APPLY_PATCH, patch_text)
    assert valid, patch_text  # random weights, yet no character the grammar refuses
    assert whole == (r.status == "completed"), (r.status, patch_text)


def _forced_input(r) -> str:
    """A forced custom call's input; cut short, the call is text: its input so far."""
    for item in r.output:
        if item.type == "custom_tool_call":
            return item.input
    head = '{"name":"apply_patch","arguments":{"input":"'
    assert r.status == "incomplete" and r.output_text.startswith(head), r.output_text
    rest = r.output_text[len(head) :]
    for cut in range(7):  # the text may end in the middle of an escape
        try:
            return json.loads(f'"{rest[: len(rest) - cut]}"')
        except ValueError:
            continue
    raise AssertionError(rest)


def test_items_of_tools_run_elsewhere_are_accepted_and_left_out(server):
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "x"}},
        {"type": "tool_search_call", "id": "ts_1", "arguments": {"q": "x"}},
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "opaque"},
        {"type": "item_reference", "id": "msg_1"},
        {"id": "msg_2"},  # an item_reference, its type left out as the spec allows
        {"type": "local_shell_call", "id": "ls_1", "call_id": "c1", "status": "completed",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "local_shell_call_output", "id": "ls_1", "output": "a.txt"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"type": "message", "role": "user", "content": "Again."},
    ]  # fmt: skip
    hosted = [*HOSTED, {"type": "computer"}, {"type": "web_search_preview_2025_03_11"}]
    body = {"model": "tiny", "input": items, "tools": hosted, "max_output_tokens": 4}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    plain = {"model": "tiny", "max_output_tokens": 4, "input": [items[0], items[-2], items[-1]]}
    again = httpx.post(server.url + "/v1/responses", json=plain, timeout=60).json()
    # Left out: the same prompt as without them.
    assert again["usage"]["input_tokens"] == r.json()["usage"]["input_tokens"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0][0]", "unsupported_content"),
        ({"tools": HOSTED, "tool_choice": {"type": "web_search"}}, "tool_choice", None),
        ({"tools": [SHELL], "tool_choice": {"type": "allowed_tools", "mode": "required",
                                            "tools": [{"type": "function", "name": "nope"}]}},
         "tool_choice", None),
        ({"tools": [{**AGENTS, "tools": "none"}]}, "tools[0]", None),
        ({"tools": [{**AGENTS, "tools": ["x"]}]}, "tools[0].tools[0]", None),
        ({"tools": [{"type": "custom", "name": "p", "format": {"type": "grammar"}}]},
         "tools[0].format", None),
        ({"tools": [{"type": "custom", "name": "p", "format": {
            "type": "grammar", "syntax": "lark", "definition": 7}}]}, "tools[0].format", None),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
         "input[0].arguments", None),
    ],
)  # fmt: skip
def test_what_cannot_be_done_says_why(server, body, param, code):
    r = httpx.post(
        server.url + "/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    if code:
        assert error["code"] == code


def test_a_chain_of_responses_by_previous_response_id(server, oai):
    first = oai.responses.create(model="tiny", input="Hi.", temperature=0, max_output_tokens=6)
    second = oai.responses.create(
        model="tiny", input="More.", previous_response_id=first.id, temperature=0,
        max_output_tokens=6,
    )  # fmt: skip
    third = oai.responses.create(
        model="tiny", input="Again.", previous_response_id=second.id, temperature=0,
        max_output_tokens=6,
    )  # fmt: skip
    assert third.previous_response_id == second.id and third.store is True
    # The same prompt as the whole conversation sent again: the stored turns came first.
    whole = [
        {"role": "user", "content": "Hi."},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"role": "user", "content": "More."},
        *[o.model_dump(exclude_none=True) for o in second.output],
        {"role": "user", "content": "Again."},
    ]
    again = oai.responses.create(model="tiny", input=whole, temperature=0, max_output_tokens=6)
    assert again.usage.input_tokens == third.usage.input_tokens
    assert again.output_text == third.output_text
    # The previous turns were cached: all of the third's prompt but its own new input.
    seen = second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= seen - 2
    with pytest.raises(openai.NotFoundError) as e:  # unknown: say to send the whole input
        oai.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found"
    unstored = oai.responses.create(model="tiny", input="Hi.", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="tiny", input="x", previous_response_id=unstored.id)


def test_a_streamed_response_is_stored_too_and_tenants_see_only_their_own(tiny_model_dir):
    from tests.live import serving

    with serving(str(tiny_model_dir), served_model_name="tiny", api_keys=["a", "b"]) as live:
        alice = openai.OpenAI(base_url=live.url + "/v1", api_key="a", max_retries=0)
        bob = openai.OpenAI(base_url=live.url + "/v1", api_key="b", max_retries=0)
        with alice.responses.stream(model="tiny", input="Hi.", max_output_tokens=4) as s:
            done = list(s)[-1].response  # response.incomplete: cut at max_output_tokens
        follow = alice.responses.create(
            model="tiny", input="More.", previous_response_id=done.id, max_output_tokens=2
        )
        assert follow.usage.input_tokens > done.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="tiny", input="x", previous_response_id=done.id)


def test_stored_responses_outlive_a_restart_with_a_cache_dir(tiny_model_dir, tmp_path):
    from tests.live import serving

    settings = {"served_model_name": "tiny", "cache_dir": str(tmp_path)}
    with serving(str(tiny_model_dir), **settings) as live:
        oai = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        first = oai.responses.create(model="tiny", input="Hi.", temperature=0, max_output_tokens=4)
    with serving(str(tiny_model_dir), **settings) as live:
        oai = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        follow = oai.responses.create(
            model="tiny", input="More.", previous_response_id=first.id, temperature=0,
            max_output_tokens=4,
        )  # fmt: skip
        whole = [{"role": "user", "content": "Hi."},
                 *[o.model_dump(exclude_none=True) for o in first.output],
                 {"role": "user", "content": "More."}]  # fmt: skip
        sent = oai.responses.create(model="tiny", input=whole, temperature=0, max_output_tokens=4)
    assert follow.usage.input_tokens == sent.usage.input_tokens
    assert follow.output_text == sent.output_text
