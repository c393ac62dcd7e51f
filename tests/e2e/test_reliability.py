"""One client must not hurt another: capacity, slow prompts, abandoned requests."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import mlx_cache_server.serving.chat as chat
from tests.helpers import wait_until
from tests.live import serving

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
NO_END = {"logit_bias": {"99": -100}}  # <|im_end|> of the tiny tokenizer: generate to the limit


@pytest.fixture(scope="module")
def small(tiny_model_dir):
    """Two generation slots and no queue: the third request at once is a 429."""
    with serving(
        str(tiny_model_dir), served_model_name="tiny", completion_batch_size=2, max_queue=0
    ) as live:
        yield live


@pytest.mark.parametrize("stream", [True, False])
def test_requests_arriving_together_get_the_slots_there_are_and_429s(small, stream):
    body = {**CHAT, **NO_END, "max_tokens": 1500, "stream": stream}
    barrier = threading.Barrier(6)

    def send(_):
        barrier.wait()
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", small.url + "/v1/chat/completions", json=body) as r:
                r.read()
                return r.status_code

    with ThreadPoolExecutor(6) as pool:
        statuses = sorted(pool.map(send, range(6)))
    assert statuses == [200, 200, 429, 429, 429, 429]
    wait_until(lambda: small.engine.in_flight == 0)  # every slot came back


def test_a_prompt_being_tokenized_does_not_stall_other_clients(small, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = chat.render_marked

    def slow_render(*args):
        entered.set()
        assert release.wait(30)
        return real(*args)

    monkeypatch.setattr(chat, "render_marked", slow_render)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, small.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert entered.wait(30)
        # Were templating on the event loop, this would wait for the release.
        assert httpx.get(small.url + "/health", timeout=10).status_code == 200
        release.set()
        assert slow.result().status_code == 200
    wait_until(lambda: small.engine.in_flight == 0)


@pytest.mark.parametrize("where", ["content", "reasoning_content"])
def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(
    small, monkeypatch, where
):
    def never(*args):
        raise AssertionError("tokenized a prompt that could never fit")

    monkeypatch.setattr(chat, "render_marked", never)
    limit = 2 * small.engine.context_length * small.engine.max_token_chars
    # A reasoning model's thinking sent back is rendered too: it counts as content does.
    long = {"role": "assistant", "content": "ok", where: "a" * (limit + 1)}
    body = {**CHAT, "messages": [long, {"role": "user", "content": "Go on."}]}
    r = httpx.post(small.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert small.engine.in_flight == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_abandoned_request_stops_generating(tiny_model_dir, path, caplog):
    with serving(str(tiny_model_dir), served_model_name="tiny") as live:
        body = {**NO_END, "model": "tiny", "max_tokens": 3000}
        body.update({"messages": CHAT["messages"]} if "chat" in path else {"prompt": "hello"})
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            wait_until(lambda: live.engine.running == 1)  # generating: now the client leaves
        wait_until(lambda: live.engine.stats.cancelled == 1)
        wait_until(lambda: live.engine.running == 0 and live.engine.in_flight == 0)
        assert live.engine.stats.finished == 0  # it did not run on to its 3000 tokens
        # Recorded as the client's going (499), not as a server error.
        wait_until(lambda: 'status="499"' in live.app.state.server.metrics.render().decode())
        assert 'status="500"' not in live.app.state.server.metrics.render().decode()
        assert "Exception in ASGI application" not in caplog.text


def test_flushes_during_inserts_leave_nothing_unreachable_and_outputs_unchanged(
    tiny_model_dir, uncached_client
):
    """An admin flushes the cache again and again while chats' turns are being inserted."""
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]

    def ask(url, question):
        body = {**CHAT, "messages": [{"role": "user", "content": question}], "max_tokens": 12}
        body["temperature"] = 0
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    expected = {
        q: uncached_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": q}],
            max_tokens=12,
            temperature=0,
        )
        .choices[0]
        .message.content
        for q in questions
    }
    with serving(str(tiny_model_dir), served_model_name="tiny") as live:
        stop = threading.Event()
        flushes = [0]

        def flush_until_stopped():
            while not stop.is_set():
                assert httpx.delete(live.url + "/v1/cache").status_code == 200
                flushes[0] += 1

        flusher = threading.Thread(target=flush_until_stopped)
        flusher.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                for _ in range(3):  # each chat again: reused where a flush did not take it
                    answers = list(pool.map(lambda q: ask(live.url, q), questions))
                    assert answers == [expected[q] for q in questions]
        finally:
            stop.set()
            flusher.join(30)
        assert flushes[0] > 0
        wait_until(lambda: live.engine.running == 0)
        httpx.delete(live.url + "/v1/cache")
        report = httpx.get(live.url + "/v1/cache").json()
        assert (report["sequences"], report["bytes"]) == (0, 0)
        assert live.engine.cache.nbytes == 0 and len(live.engine.cache) == 0
