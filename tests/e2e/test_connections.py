"""Hostile connections: huge or many headers, headers sent slowly, clients that never read."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.helpers import wait_until
from tests.live import serving

NO_END = {"logit_bias": {"99": -100}}  # <|im_end|> of the tiny tokenizer: generate to the limit


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    with serving(
        str(tiny_model_dir),
        served_model_name="tiny",
        header_timeout=1.0,
        write_timeout=1.0,
        body_timeout=1.0,
    ) as live:
        yield live


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_all(sock: socket.socket, seconds: float = 10) -> bytes:
    sock.settimeout(seconds)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_headers_too_large_get_a_431_and_the_connection_closes(guarded):
    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        status, error = status_and_error(read_all(sock))
    assert status == 431 and error["code"] == "request_headers_too_large"
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_refused_connection_answers_in_the_shape_of_the_api_asked(guarded):
    with connect(guarded) as sock:
        big = b"X-Big: " + b"a" * 200_000
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n\r\n")
        response = read_all(sock)
    head, _, body = response.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 431
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": json.loads(body)["error"]["message"]},
    }


def test_too_many_headers_get_a_431(guarded):
    headers = {f"x-h{i}": "1" for i in range(150)}
    r = httpx.get(guarded.url + "/health", headers=headers)
    assert r.status_code == 431 and r.json()["error"]["code"] == "too_many_headers"


def test_headers_sent_a_byte_at_a_time_are_cut_off(guarded):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    with connect(guarded) as sock:
        start = time.monotonic()
        closed = False
        try:
            for byte in request:  # far slower than the 1 s the server gives
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:  # the server closed the connection under us
            closed = True
        response = read_all(sock)
    assert closed or response  # cut off before the 10 s the headers would take
    if response:
        assert status_and_error(response)[0] == 408
    assert time.monotonic() - start < 8


def test_a_body_sent_a_trickle_at_a_time_gets_a_408(guarded):
    with connect(guarded) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"'
        )  # and then nothing
        status, error = status_and_error(read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(guarded):
    with connect(guarded) as sock:
        start = time.monotonic()
        assert read_all(sock) == b""
        assert time.monotonic() - start < 8


def test_the_header_deadline_does_not_cut_a_long_generation(guarded):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **NO_END}
    with httpx.Client(timeout=60) as client:  # one keep-alive connection for both requests
        start = time.monotonic()
        r = client.post(guarded.url + "/v1/chat/completions", json={**body, "max_tokens": 2000})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2000
        assert time.monotonic() - start > 1  # longer than the 1 s header deadline
        assert client.get(guarded.url + "/health").status_code == 200


def test_a_client_that_never_reads_loses_its_stream_and_its_connection(guarded):
    engine, connections = guarded.engine, guarded._server.server_state.connections
    cancelled = engine.stats.cancelled
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4000,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,  # about 2 KB an event: the socket buffers fill quickly
            **NO_END,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", guarded.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: engine.stats.cancelled > cancelled)  # never reading
        # Dropped while the client still holds its socket: it no longer counts against the cap.
        port = sock.getsockname()[1]
        wait_until(lambda: all(c.client[1] != port for c in list(connections)), seconds=10)
        wait_until(lambda: engine.in_flight == 0, seconds=10)
    finally:
        sock.close()


def test_pipelined_requests_are_not_cut_by_the_header_deadline(guarded):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **NO_END}
    first = json.dumps({**chat, "max_tokens": 4}).encode()
    second = json.dumps({**chat, "max_tokens": 2000, "stream": True}).encode()  # well over 1 s

    def request(body: bytes, extra: bytes = b"") -> bytes:
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + extra
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    with connect(guarded) as sock:
        sock.sendall(request(first) + request(second, b"Connection: close\r\n"))
        response = read_all(sock, seconds=60)
    assert response.count(b"HTTP/1.1 200") == 2
    assert b"data: [DONE]" in response


def test_connections_past_the_cap_are_closed(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", max_connections=2) as live:
        held = [connect(live), connect(live)]
        try:
            with connect(live) as extra:
                try:
                    assert read_all(extra, seconds=5) == b""
                except ConnectionResetError:
                    pass  # closed at once, either way
            for sock in held:  # those within the cap still work
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert read_all(sock).startswith(b"HTTP/1.1 200")
        finally:
            for sock in held:
                sock.close()
