"""A streamed request whose model is still loading, through the official SDKs: its response
starts while the model loads, with keep-alives, then streams as it would have; a load that
fails once the stream has started, or a server that stops meanwhile, comes as the API's
error event, which the SDK raises; within the grace, a failing load keeps its status."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk

from mlx_cache_server.models.specs import ModelSpec
from mlx_cache_server.server import while_loading
from tests.e2e.test_models import serving_models
from tests.helpers import wait_until
from tests.tiny_model import build_tiny_model

QUESTION = [{"role": "user", "content": "What is two plus two?"}]
PROMPT = "Two plus two is"
TIMEOUT = 20  # seconds: a response that waits for the load fails the test by then


class Gate:
    """The loader's `open`, held until `release` (then failing with `error`, if given)."""

    def __init__(self, pool, error: Exception | None = None) -> None:
        self.called, self.released, self.error = threading.Event(), threading.Event(), error
        self.pool, self._open = pool, pool.loader.open
        pool.loader.open = self.open

    def open(self, spec):
        self.called.set()
        self.released.wait(60)
        if self.error is not None:
            raise self.error
        return self._open(spec)

    def release(self) -> None:
        self.released.set()

    def remove(self) -> None:
        self.pool.loader.open = self._open


@contextmanager
def two_models(a: Path, b: Path, grace: float, monkeypatch) -> Iterator:
    """A server of models "a" (loaded) and "b" (loaded on its first request); streams wait
    `grace` seconds for a model, then keep alive every 0.05 s."""
    monkeypatch.setattr(while_loading, "LOAD_GRACE", grace)
    monkeypatch.setattr(while_loading, "KEEP_ALIVE_EVERY", 0.05)
    monkeypatch.setattr(while_loading, "STOP_POLL", 0.01)
    specs = [ModelSpec("a", str(a), pinned=True), ModelSpec("b", str(b))]
    with serving_models(specs, admin_key="adm") as server:
        yield server


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(Path(tmp_path_factory.mktemp("tiny-b")), seed=1)


def unload(server) -> None:
    """Model "b" unloaded, once its last request has let go of it."""

    def unloaded() -> bool:
        r = httpx.post(server.url + "/v1/models/b/unload", headers={"Authorization": "Bearer adm"})
        return r.status_code == 200 and r.json()["loaded"] is False

    wait_until(unloaded, seconds=TIMEOUT)


class Clients:
    """Both SDKs' clients, noting when a response's status and headers arrive."""

    def __init__(self, url: str) -> None:
        self.started = threading.Event()
        hooks = {"response": [lambda response: self.started.set()]}
        self.openai = OpenAI(
            base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT,
            http_client=openai.DefaultHttpxClient(event_hooks=hooks),
        )  # fmt: skip
        self.anthropic = anthropic.Anthropic(
            base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT,
            http_client=anthropic.DefaultHttpxClient(event_hooks=hooks),
        )  # fmt: skip


def started_first(gate: Gate, clients: Clients, call: Callable[[], object]) -> dict:
    """`call()` on a thread; its response must start while the load is held, and the load
    is released only then. Its outcome: {"value": ...} or {"error": ...}."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except Exception as e:  # the test reads it
            out["error"] = e

    clients.started.clear()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        held = lambda: clients.started.is_set() and gate.called.is_set()  # noqa: E731
        wait_until(lambda: held() or not thread.is_alive(), seconds=TIMEOUT)
        assert clients.started.is_set() and gate.called.is_set() and thread.is_alive(), out
    finally:
        gate.release()
        thread.join(TIMEOUT)
    assert not thread.is_alive()
    return out


def greedy(c: OpenAI) -> str:
    """Model "b"'s greedy answer, not streamed."""
    r = c.chat.completions.create(model="b", messages=QUESTION, max_tokens=12, temperature=0)
    return r.choices[0].message.content


def test_a_stream_keeps_alive_while_its_model_loads_then_streams_as_usual(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        gate = Gate(server.pool)
        raw = c.chat.completions.with_streaming_response.create(
            model="b", messages=QUESTION, max_tokens=12, temperature=0, stream=True
        )
        with raw as response:  # the status is here while the load is held
            assert response.status_code == 200 and not gate.released.is_set()
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert first == ": keep-alive" and not gate.released.is_set()
            gate.release()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and all(
            line.startswith("data: ") or line == ": keep-alive" for line in rest
        )
        data = [line[6:] for line in rest if line.startswith("data: {")]
        chunks = [ChatCompletionChunk.model_validate_json(d) for d in data]
        streamed = "".join(k.choices[0].delta.content or "" for k in chunks if k.choices)
        assert streamed == greedy(c) and streamed


def _anthropic_text(a: anthropic.Anthropic) -> str:
    with a.messages.stream(
        model="b", messages=QUESTION, max_tokens=12, extra_body={"temperature": 0}
    ) as stream:
        return "".join(stream.text_stream)


def test_each_apis_sdk_reads_a_stream_that_started_while_its_model_loaded(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        clients = Clients(server.url)
        c = clients.openai
        calls = {
            "chat": lambda: "".join(
                chunk.choices[0].delta.content or ""
                for chunk in c.chat.completions.create(
                    model="b", messages=QUESTION, max_tokens=12, temperature=0, stream=True
                )
                if chunk.choices
            ),
            "completions": lambda: "".join(
                chunk.choices[0].text
                for chunk in c.completions.create(
                    model="b", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
                )
                if chunk.choices
            ),
            "messages": lambda: _anthropic_text(clients.anthropic),
            "responses": lambda: "".join(
                event.delta
                for event in c.responses.create(
                    model="b", input=QUESTION, max_output_tokens=12, temperature=0, stream=True
                )
                if event.type == "response.output_text.delta"
            ),
        }
        answers = {}
        for name, call in calls.items():
            unload(server)
            gate = Gate(server.pool)
            out = started_first(gate, clients, call)
            gate.remove()
            assert "error" not in out, (name, out.get("error"))
            answers[name] = out["value"]
        completion = c.completions.create(model="b", prompt=PROMPT, max_tokens=12, temperature=0)
        expected = dict.fromkeys(calls, greedy(c)) | {"completions": completion.choices[0].text}
        assert answers == expected and answers["chat"] and answers["completions"]


def test_a_load_failing_after_the_stream_started_is_each_apis_error_event(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        clients = Clients(server.url)
        c, a = clients.openai, clients.anthropic

        def chat() -> None:
            for _ in c.chat.completions.create(
                model="b", messages=QUESTION, max_tokens=4, stream=True
            ):
                pass

        def completions() -> None:
            for _ in c.completions.create(model="b", prompt="Hi", max_tokens=4, stream=True):
                pass

        def messages() -> None:
            with a.messages.stream(model="b", messages=QUESTION, max_tokens=4) as s:
                for _ in s.text_stream:
                    pass

        def responses() -> tuple[list, object]:
            events = list(c.responses.create(model="b", input=QUESTION, stream=True))
            with c.responses.stream(model="b", input=QUESTION) as stream:  # the SDK's helper
                helper = list(stream)
            return events, helper

        outcomes = {}
        for name, call in dict(
            chat=chat, completions=completions, messages=messages, responses=responses
        ).items():
            gate = Gate(server.pool, error=OSError("weights unreadable"))
            if name == "responses":  # two requests: the second's load fails at once
                gate.release()
            outcomes[name] = started_first(gate, clients, call)
            gate.remove()
        for name in ("chat", "completions", "messages"):
            error = outcomes[name].get("error")
            assert isinstance(error, openai.APIError | anthropic.APIError), (name, outcomes[name])
            assert getattr(error, "status_code", 200) == 200  # the stream's, not a status's
            assert "could not be loaded" in str(error) and "weights unreadable" in str(error)
        assert "value" in outcomes["responses"], outcomes["responses"]
        for events in outcomes["responses"]["value"]:
            assert [e.type for e in events] == ["response.created", "response.failed"]
            assert "weights unreadable" in events[-1].response.error.message
            assert events[-1].response.status == "failed"
        # The model loads on the next request: the failed ones left nothing behind.
        assert c.chat.completions.create(model="b", messages=QUESTION, max_tokens=4).choices


def test_a_stream_waiting_for_its_model_ends_with_an_error_when_the_server_stops(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        gate = Gate(server.pool)
        raw = c.chat.completions.with_streaming_response.create(
            model="b", messages=QUESTION, max_tokens=4, stream=True
        )
        try:
            with raw as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line) == ": keep-alive"
                server.pool.stopping.set()  # as the shutdown does once its grace is over
                rest = [line for line in lines if line and line != ": keep-alive"]
        finally:
            gate.release()
        assert rest[-1] == "data: [DONE]" and len(rest) == 2
        assert "shutting down" in rest[0] and '"service_unavailable"' in rest[0]


def test_a_load_failing_within_the_grace_keeps_its_status(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 60.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        gate = Gate(server.pool, error=OSError("weights unreadable"))
        gate.release()
        with pytest.raises(openai.APIStatusError) as failed:
            c.chat.completions.create(model="b", messages=QUESTION, max_tokens=4, stream=True)
        assert failed.value.status_code == 503 and "weights unreadable" in failed.value.message
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=QUESTION, max_tokens=4, stream=True)


@pytest.mark.parametrize("grace", [0.0, 0.5])
def test_a_client_gone_while_its_model_loads_holds_nothing(
    tiny_model_dir, second_model_dir, monkeypatch, grace
):
    """Gone during the keep-alives (no grace), or before its response started (within it)."""
    with two_models(tiny_model_dir, second_model_dir, grace, monkeypatch) as server:
        gate = Gate(server.pool)
        url = server.url + "/v1/chat/completions"
        body = {"model": "b", "messages": QUESTION, "max_tokens": 4, "stream": True}
        if grace == 0:
            with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as response:
                assert next(line for line in response.iter_lines() if line) == ": keep-alive"
        else:  # its connection closed as soon as the request is sent
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=body, timeout=0.05)
        assert gate.called.wait(TIMEOUT)
        gate.release()
        wait_until(lambda: server.pool.get("b") is not None, seconds=TIMEOUT)
        unload(server)  # refused while anything holds the model
