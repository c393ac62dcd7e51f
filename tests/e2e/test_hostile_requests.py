"""Requests sent to starve the server (issue 55), through the official SDKs against a
server process of its own: text hidden in tools and tool calls, huge and malformed
grammars, counted repetitions, sent several at once beside a plain request. Each gets
its 4xx (or, for a grammar a custom tool may leave unenforced, its answer); the plain
request is answered, and `/health` stays up."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import anthropic
import httpx
import openai
import pytest

from tests.live import server_process

ASK = [{"role": "user", "content": "Say something."}]
MB = 1 << 20


@pytest.fixture(scope="module")
def own_server(tiny_model_dir, tmp_path_factory):
    with server_process(tiny_model_dir, tmp_path_factory.mktemp("hostile") / "log") as started:
        yield started


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def status_of(call) -> tuple[int, str | None]:
    """The HTTP status a call ends with, and its error code."""
    try:
        call()
    except openai.APIStatusError as e:
        return e.status_code, (e.body or {}).get("code") if isinstance(e.body, dict) else None
    except anthropic.APIStatusError as e:
        return e.status_code, None
    return 200, None


def tools_with_text(size: int) -> list[dict]:
    """Tools whose descriptions and schemas hold `size` characters: what a template writes
    into the prompt, though no message holds any of it."""
    each = size // 8
    return [{"type": "function", "function": {
        "name": f"f{i}", "description": "d" * each,
        "parameters": {"type": "object", "properties": {"a": {
            "type": "string", "description": "p" * each}}}}} for i in range(4)]  # fmt: skip


def chat_big_tools(url: str) -> None:
    oai(url).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=4, tools=tools_with_text(7 * MB)
    )


def chat_big_tool_call_history(url: str) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f0", "arguments": '{"a": "' + "x" * (7 * MB) + '"}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]  # fmt: skip
    oai(url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, tools=tools_with_text(100)
    )


def messages_big_tools(url: str) -> None:
    tools = [{"name": f"f{i}", "description": "d" * (2 * MB),
              "input_schema": {"type": "object"}} for i in range(3)]  # fmt: skip
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
    client.messages.create(model="tiny", messages=ASK, max_tokens=4, tools=tools)


def lark_tool(definition: str, syntax: str = "lark") -> dict:
    return {"type": "custom", "name": "patch", "description": "Edits files.",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition}}  # fmt: skip


def responses_lark_of_a_megabyte(url: str) -> None:
    rules = "".join(f'r{i}: "x{i}" | r{i + 1}\n' for i in range(60_000)) + 'r60000: "end"\n'
    oai(url).responses.create(model="tiny", input="Edit.", max_output_tokens=8,
                              tools=[lark_tool("start: r0\n" + rules)])  # fmt: skip


def chat_counted_repetition(url: str) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a{1000000}$"}},
    }
    oai(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                     response_format=fmt)  # fmt: skip


def chat_long_const(url: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "y" * 500_000}}}
    oai(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                     response_format=fmt)  # fmt: skip


HOSTILE = {
    chat_big_tools: (400, "context_length_exceeded"),
    chat_big_tool_call_history: (400, "context_length_exceeded"),
    messages_big_tools: (400, None),
    responses_lark_of_a_megabyte: (400, "context_length_exceeded"),
    chat_counted_repetition: (400, "schema_too_large"),
    chat_long_const: (400, "schema_too_large"),
}


def test_hostile_requests_get_their_4xx_while_a_plain_one_is_answered(own_server):
    proc, url = own_server
    with concurrent.futures.ThreadPoolExecutor(len(HOSTILE) + 1) as pool:
        hostile = {pool.submit(status_of, lambda f=f: f(url)): f for f in HOSTILE}
        plain = pool.submit(
            oai(url).chat.completions.create, model="tiny", messages=ASK, max_tokens=8
        )
        reply = plain.result(timeout=300)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(url + "/health").status_code == 200
        for future, f in hostile.items():
            status, code = future.result(timeout=300)
            want_status, want_code = HOSTILE[f]
            assert status == want_status, (f.__name__, status, code)
            if want_code is not None:
                assert code == want_code, (f.__name__, code)
    assert proc.poll() is None
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize(
    "tool",
    [
        lark_tool('start: "a"~1000000'),  # llguidance fails at the reply's second token
        lark_tool("(a{1000}){1000}", syntax="regex"),
        lark_tool('start: "a"~'),  # malformed: an IndexError, a 500, before
        lark_tool('start: "\\x"'),  # a SyntaxError
        lark_tool("start: " + "(" * 600 + '"a"' + ")" * 600),  # a RecursionError
    ],
    ids=["lark count", "regex count", "no count", "bad string", "deep"],
)
def test_a_custom_grammar_that_cannot_be_held_is_left_free_and_answered(own_server, tool):
    proc, url = own_server
    out = oai(url).responses.create(
        model="tiny", input="Edit.", max_output_tokens=8, tools=[tool], tool_choice="required"
    )
    assert out.status in ("completed", "incomplete")
    assert proc.poll() is None


def test_a_plain_chat_is_answered_while_grammars_hold_every_grammar_thread(server, monkeypatch):
    """Requests whose grammars take long to compile fill the grammar threads and queue
    behind them; a chat without a grammar is answered meanwhile (an ordering check: it
    ends while they are all still held), and they are answered once let go. There are
    more of them than asyncio's default pool has threads, which they used to share with
    every chat's templating."""
    from mlx_cache_server.serving import chat as chat_module
    from mlx_cache_server.serving.workers import GRAMMARS
    from tests.helpers import wait_until

    release, entered = threading.Event(), []
    compile_format = chat_module.response_format_grammar

    def held(response_format):
        entered.append(response_format)
        release.wait(60)
        return compile_format(response_format)

    monkeypatch.setattr(chat_module, "response_format_grammar", held)
    client = oai(server.url)
    fmt = {"type": "json_object"}
    count = min(32, (os.cpu_count() or 1) + 4) + 1
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        grammars = [
            pool.submit(
                client.chat.completions.create,
                model="tiny",
                messages=ASK,
                max_tokens=4,
                response_format=fmt,
            )
            for _ in range(count)
        ]
        try:
            wait_until(lambda: len(entered) == GRAMMARS.workers)
            plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8)
            assert plain.choices[0].finish_reason in ("stop", "length")
            assert not any(f.done() for f in grammars)
        finally:
            release.set()
        for f in grammars:
            assert f.result(timeout=300).choices[0].finish_reason in ("stop", "length")
    assert len(entered) == count
