"""The request bodies the real agents sent (tests/fixtures/agents/, recorded through a proxy)
replayed as they were, on a template without tools and on one with: each is answered 200 and
well formed, in its API's stream or body."""

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
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert [d["sequence_number"] for _, d in stream] == list(range(len(stream)))
    done = stream[-1][1]["response"]
    (message,) = [o for o in done["output"] if o["type"] == "message"]
    assert message["content"][0]["text"] == "Hello there!"


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
@pytest.mark.parametrize("template", ["no tools", "tools"])
def test_a_recorded_agent_request_is_answered_as_its_api_says(
    fixture, template, agent_server, agent_tools_server
):
    url, _ = agent_server if template == "no tools" else agent_tools_server
    recorded = json.loads(fixture.read_text())
    # As sent, but for the reply's length: the agents ask for up to 64,000 tokens.
    body = (
        {**recorded["body"], "max_tokens": 48}
        if recorded["path"] == "/v1/messages"
        else {**recorded["body"], "max_output_tokens": 48}
    )
    path = recorded["path"] + (f"?{recorded['query']}" if recorded["query"] else "")
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()[:2000]
        stream = events(r)
    (check_messages if recorded["path"] == "/v1/messages" else check_responses)(stream, body)
