"""The request bodies the real agents sent (tests/fixtures/agents/, recorded through a proxy)
replayed as they were (a WebSocket's `response.create` as the POST it stands for), on a
template without tools and on one with: each is answered 200 and well formed, in its API's
stream or body."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

FIXTURES = sorted((Path(__file__).parent.parent / "fixtures" / "agents").glob("*.json"))


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    out, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((kind, json.loads(line[len("data: ") :])))
    return out


def check_messages(stream: list[tuple[str, dict]], body: dict) -> None:
    kinds = [k for k, _ in stream if k != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    text = "".join(d["delta"].get("text", "") for k, d in stream if k == "content_block_delta")
    (delta,) = [d for k, d in stream if k == "message_delta"]
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is not None:  # structured output, as Claude Code asks for its session titles
        # Held in the grammar the model's reply is sampled text: whole JSON if it ended,
        # the start of it if max_tokens cut it.
        if delta["delta"]["stop_reason"] == "end_turn":
            assert set(json.loads(text)) == set(fmt["schema"]["required"])
        else:
            assert delta["delta"]["stop_reason"] == "max_tokens"
            assert text.startswith('{"title":"')
    else:
        assert text == "Hello there!" and delta["delta"]["stop_reason"] == "end_turn"


def check_responses(stream: list[tuple[str, dict]], body: dict) -> None:
    kinds = [k for k, _ in stream]
    ends = ("response.completed", "response.incomplete")
    assert kinds[0] == "response.created" and kinds[-1] in ends, kinds
    assert [d["sequence_number"] for _, d in stream] == list(range(len(stream)))
    check_response(stream[-1][1]["response"], body)


def check_response(done: dict, body: dict) -> None:
    if body.get("tool_choice") == "required":  # a call, or its start where the limit cut it
        calls = [o for o in done["output"] if o["type"] == "function_call"]
        if done["status"] == "completed":
            assert calls and all(json.loads(c["arguments"]) is not None for c in calls)
        else:  # the call cut short is still the call, incomplete (issue 59)
            assert done["status"] == "incomplete" and len(calls) == len(done["output"]), done
            assert calls and all(c["status"] == "incomplete" for c in calls), done
        return
    assert done["status"] == "completed", done
    (message,) = [o for o in done["output"] if o["type"] == "message"]
    assert message["content"][0]["text"] == "Hello there!"


def check_chat(chunks: list[dict], body: dict) -> None:
    """Chat completions, streamed (as chunks) or not (one body as a chunk)."""
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    parts = [c.get("delta") or c.get("message") or {} for c in choices]
    text = "".join(p.get("content") or "" for p in parts)
    finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    assert len(finish) == 1, choices
    if body.get("stream_options", {}).get("include_usage"):
        assert chunks[-1]["usage"]["prompt_tokens"] > 0 and not chunks[-1]["choices"]
    if body.get("tool_choice") == "required":
        calls = [t for p in parts for t in p.get("tool_calls") or []]
        names = {t["function"]["name"] for t in body["tools"]}
        if finish[0] == "tool_calls":
            assert calls and {c["function"]["name"] for c in calls} <= names
        else:  # cut short: still a call, never text (issue 59)
            assert finish[0] == "length" and calls and not text, (finish, text)
            cut = [c["function"]["name"] for c in calls if c.get("id")]  # a name maybe too
            assert cut and all(any(n.startswith(c) for n in names) for c in cut), cut
        return
    assert text == "Hello there!" and finish[0] == "stop", (text, finish)


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
@pytest.mark.parametrize("template", ["no tools", "tools"])
def test_a_recorded_agent_request_is_answered_as_its_api_says(
    fixture, template, agent_server, agent_tools_server
):
    url, _ = agent_server if template == "no tools" else agent_tools_server
    recorded = json.loads(fixture.read_text())
    # As sent, but for the reply's length: the agents ask for up to 64,000 tokens.
    limit = "max_output_tokens" if recorded["path"] == "/v1/responses" else "max_tokens"
    body = {**recorded["body"], limit: 48}
    path = recorded["path"] + (f"?{recorded['query']}" if recorded["query"] else "")
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()[:2000]
        if not body.get("stream"):
            done = json.loads(r.read())
            check_response(done, body) if path == "/v1/responses" else check_chat([done], body)
            return
        stream = events(r)
    if recorded["path"] == "/v1/chat/completions":
        check_chat([data for _, data in stream], body)
    else:
        (check_messages if recorded["path"] == "/v1/messages" else check_responses)(stream, body)
