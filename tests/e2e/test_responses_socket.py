"""The Responses API over a WebSocket (`GET /v1/responses` upgraded), through the `openai`
SDK's own client (`responses.connect()`): the events the SSE stream sends, the same cache, a
connection's last response chained with `store: false` as Codex chains it, and the key
checked on the upgrade."""

from __future__ import annotations

import json
import time

import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.live import serving

PROMPT = "Tell me about the weather in a few words, please. " * 8


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny") as server:
        yield server


def events_of(connection) -> list:
    """A response's events, from its `response.created` to its end."""
    out = []
    for event in connection:
        out.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            return out
        assert event.type != "error", event
    raise AssertionError(out)


def test_a_response_streams_the_sse_events_and_the_next_turn_is_cached(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    http = list(client.responses.create(model="tiny", input=PROMPT, max_output_tokens=8,
                                        temperature=0, stream=True))  # fmt: skip
    with client.responses.connect() as connection:
        connection.response.create(model="tiny", input=PROMPT, max_output_tokens=8,
                                   temperature=0, store=False)  # fmt: skip
        first = events_of(connection)
        assert [e.type for e in first] == [e.type for e in http]
        assert [e.sequence_number for e in first] == list(range(len(first)))
        done = first[-1].response
        assert done.output_text == http[-1].response.output_text
        # The prompt was the HTTP request's: served from the cache.
        assert done.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens - 16
        # The next turn names the last response and sends only its new input, store off.
        follow = [{"role": "user", "content": "And tomorrow?"}]
        connection.response.create(model="tiny", input=follow, max_output_tokens=8,
                                    previous_response_id=done.id, store=False)  # fmt: skip
        second = events_of(connection)[-1].response
        assert second.status in ("completed", "incomplete")
        assert second.usage.input_tokens > done.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens - 16


def test_an_error_is_an_event_and_the_socket_serves_on(live):
    url = live.url.replace("http", "ws") + "/v1/responses"
    with connect(url) as socket:
        socket.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi",
                                "previous_response_id": "resp_unknown"}))  # fmt: skip
        error = json.loads(socket.recv(timeout=60))
        assert error["type"] == "error" and error["status"] == 404, error
        assert error["error"]["code"] == "previous_response_not_found"
        socket.send(json.dumps({"type": "response.cancel"}))
        error = json.loads(socket.recv(timeout=60))
        assert error["status"] == 400 and error["error"]["param"] == "type", error
        socket.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi",
                                "max_output_tokens": 2}))  # fmt: skip
        kinds = [json.loads(socket.recv(timeout=60))["type"]]
        while kinds[-1] not in ("response.completed", "response.incomplete"):
            kinds.append(json.loads(socket.recv(timeout=60))["type"])
        assert kinds[0] == "response.created"


def test_the_key_is_checked_on_the_upgrade(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", api_keys=["sesame"]) as keyed:
        url = keyed.url.replace("http", "ws") + "/v1/responses"
        with pytest.raises(InvalidStatus) as refused:
            connect(url, additional_headers={"Authorization": "Bearer wrong"})
        assert refused.value.response.status_code == 401
        body = json.loads(refused.value.response.body)
        assert body["error"]["code"] == "invalid_api_key"
        with connect(url, additional_headers={"Authorization": "Bearer sesame"}) as socket:
            socket.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi",
                                    "max_output_tokens": 2}))  # fmt: skip
            assert json.loads(socket.recv(timeout=60))["type"] == "response.created"


def test_a_warm_up_generates_nothing_and_the_next_request_names_it(live):
    """Codex's first request on a new socket: `generate: false`, no input."""
    url = live.url.replace("http", "ws") + "/v1/responses"
    with connect(url) as socket:
        socket.send(json.dumps({"type": "response.create", "model": "tiny", "input": [],
                                "store": False, "generate": False}))  # fmt: skip
        created, done = (json.loads(socket.recv(timeout=60)) for _ in range(2))
        assert created["type"] == "response.created" and done["type"] == "response.completed"
        assert done["response"]["output"] == [] and done["response"]["usage"]["input_tokens"] == 0
        socket.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi",
                                "max_output_tokens": 2, "store": False,
                                "previous_response_id": done["response"]["id"]}))  # fmt: skip
        kinds = [json.loads(socket.recv(timeout=60))["type"]]
        while kinds[-1] not in ("response.completed", "response.incomplete", "error"):
            kinds.append(json.loads(socket.recv(timeout=60))["type"])
        assert kinds[0] == "response.created" and kinds[-1] != "error", kinds


def test_the_tools_of_an_additional_tools_item_are_offered():
    """Codex asking for "responses lite" (as it does with only `openai_base_url`) sends its
    tools in an input item, not in `tools`."""
    from mlx_cache_server.serving.responses_input import ResponsesRequest, to_chat

    tool = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
    item = {"type": "additional_tools", "role": "developer", "tools": [tool]}
    req = ResponsesRequest(model="m", input=[item, {"role": "user", "content": "hi"}])
    chat, offered = to_chat(req)
    assert [t["function"]["name"] for t in chat.tools] == ["exec_command"]
    assert "exec_command" in offered


def test_a_socket_outlives_the_deadline_for_a_requests_headers(tiny_model_dir):
    """Its upgrade request's headers came in time: the deadline for the next request's is
    not the socket's (Codex's first response, a long prefill, was cut at it)."""
    with serving(str(tiny_model_dir), served_model_name="tiny", header_timeout=0.5) as quick:
        with connect(quick.url.replace("http", "ws") + "/v1/responses") as socket:
            time.sleep(1.5)
            socket.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi",
                                    "max_output_tokens": 2}))  # fmt: skip
            assert json.loads(socket.recv(timeout=60))["type"] == "response.created"
