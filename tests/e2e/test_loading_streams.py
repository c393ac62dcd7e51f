"""A streamed request whose model is still loading, through the official SDKs: its stream
starts with keep-alives while the model loads, then comes as it would have; a load that
fails once the stream has started comes as the API's error event, which the SDK raises;
within the grace, a failing load keeps its status."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk

from app.models.specs import ModelSpec
from app.server import loading
from tests.e2e.test_models import serving_models
from tests.helpers import wait_until

QUESTION = [{"role": "user", "content": "What is two plus two?"}]


class Gate:
    """The loader's `open`, held until `release` (or failing with `error` once released)."""

    def __init__(self, pool, error: Exception | None = None) -> None:
        self.called, self.released, self.error = threading.Event(), threading.Event(), error
        self._open = pool.loader.open
        pool.loader.open = self.open

    def open(self, spec):
        self.called.set()
        self.released.wait(60)
        if self.error is not None:
            raise self.error
        return self._open(spec)

    def release(self) -> None:
        self.released.set()


@contextmanager
def two_models(a: Path, b: Path, grace: float, monkeypatch) -> Iterator:
    """A server of models "a" (loaded) and "b" (loaded on its first request); streams wait
    `grace` seconds for a model, keep-alives every 0.05 s."""
    monkeypatch.setattr(loading, "LOAD_GRACE", grace)
    monkeypatch.setattr(loading, "KEEP_ALIVE_EVERY", 0.05)
    specs = [ModelSpec("a", str(a), pinned=True), ModelSpec("b", str(b))]
    with serving_models(specs, admin_key="adm") as server:
        yield server


def unload(server) -> None:
    """Model "b" unloaded (once its last request has let go of it)."""

    def unloaded() -> bool:
        r = httpx.post(server.url + "/v1/models/b/unload", headers={"Authorization": "Bearer adm"})
        return r.status_code == 200

    wait_until(unloaded)


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory) -> Path:
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(Path(tmp_path_factory.mktemp("tiny-b")), seed=1)


def whole(c: OpenAI) -> str:
    """Model "b"'s greedy answer, not streamed."""
    r = c.chat.completions.create(model="b", messages=QUESTION, max_tokens=12, temperature=0)
    return r.choices[0].message.content


def in_background(gate: Gate, call) -> dict:
    """`call()` on a thread, the gate released once the load waits on it; its outcome."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except Exception as e:  # the test reads it
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: gate.called.is_set() or not thread.is_alive())
    assert gate.called.is_set(), f"the request never started the model's load: {out}"
    gate.release()
    thread.join(60)
    assert not thread.is_alive()
    return out


def test_a_stream_keeps_alive_while_its_model_loads_then_streams_as_usual(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
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
        assert streamed == whole(c) and streamed


def anthropic_text(a: anthropic.Anthropic) -> str:
    with a.messages.stream(
        model="b", messages=QUESTION, max_tokens=12, extra_body={"temperature": 0}
    ) as stream:
        return "".join(stream.text_stream)


def test_each_apis_sdk_reads_a_stream_whose_model_was_loading(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        a = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        answers = {}
        calls = {
            "chat": lambda: "".join(
                chunk.choices[0].delta.content or ""
                for chunk in c.chat.completions.create(
                    model="b", messages=QUESTION, max_tokens=12, temperature=0, stream=True
                )
                if chunk.choices
            ),
            "messages": lambda: anthropic_text(a),
            "responses": lambda: "".join(
                event.delta
                for event in c.responses.create(
                    model="b", input=QUESTION, max_output_tokens=12, temperature=0, stream=True
                )
                if event.type == "response.output_text.delta"
            ),
        }
        greedy = whole(c)
        for name, call in calls.items():
            unload(server)
            gate = Gate(server.pool)
            out = in_background(gate, call)
            assert "error" not in out, (name, out.get("error"))
            answers[name] = out["value"]
            server.pool.loader.open = gate._open
        assert answers == dict.fromkeys(calls, greedy)


def test_a_load_failing_after_the_stream_started_is_each_apis_error_event(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        a = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)

        def chat() -> None:
            for _ in c.chat.completions.create(
                model="b", messages=QUESTION, max_tokens=4, stream=True
            ):
                pass

        def messages() -> None:
            with a.messages.stream(model="b", messages=QUESTION, max_tokens=4) as s:
                for _ in s.text_stream:
                    pass

        def responses() -> list:
            return list(c.responses.create(model="b", input=QUESTION, stream=True))

        outcomes = {}
        for name, call in {"chat": chat, "messages": messages, "responses": responses}.items():
            gate = Gate(server.pool, error=OSError("weights unreadable"))
            outcomes[name] = in_background(gate, call)
            server.pool.loader.open = gate._open
        for name in ("chat", "messages"):
            error = outcomes[name].get("error")
            assert isinstance(error, openai.APIError | anthropic.APIError), (name, outcomes[name])
            assert "could not be loaded" in str(error) and "weights unreadable" in str(error)
        events = outcomes["responses"].get("value")
        assert events is not None, outcomes["responses"]
        assert [e.type for e in events] == ["error"]
        assert "could not be loaded" in events[0].message and events[0].code == "model_unavailable"
        # The model loads on the next request, the failed ones having left nothing behind.
        r = c.chat.completions.create(model="b", messages=QUESTION, max_tokens=4)
        assert r.choices[0].message.content is not None


def test_a_load_failing_within_the_grace_keeps_its_status(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 60.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        gate = Gate(server.pool, error=OSError("weights unreadable"))
        gate.release()
        with pytest.raises(openai.APIStatusError) as failed:
            c.chat.completions.create(model="b", messages=QUESTION, max_tokens=4, stream=True)
        assert failed.value.status_code == 503 and "weights unreadable" in failed.value.message
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=QUESTION, max_tokens=4, stream=True)


def test_a_client_gone_while_its_model_loads_holds_nothing(
    tiny_model_dir, second_model_dir, monkeypatch
):
    with two_models(tiny_model_dir, second_model_dir, 0.0, monkeypatch) as server:
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        gate = Gate(server.pool)
        raw = c.chat.completions.with_streaming_response.create(
            model="b", messages=QUESTION, max_tokens=12, stream=True
        )
        with raw as response:
            assert next(line for line in response.iter_lines() if line) == ": keep-alive"
        # Gone before the load ended: once it ends, the model is loaded and held by nobody.
        gate.called.wait(60)
        gate.release()
        wait_until(lambda: server.pool.get("b") is not None)
        r = httpx.post(server.url + "/v1/models/b/unload", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json()["loaded"] is False
