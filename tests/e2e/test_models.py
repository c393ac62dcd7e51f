"""Several models in one server, through the `openai` SDK: each answers with its own
outputs and its own cache, loads on first use, is unloaded for room (never under a running
request) or after its ttl, and is listed, loaded and unloaded as chat UIs and admins expect."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from mlx_cache_server.models.specs import ModelSpec
from mlx_cache_server.serving.metrics import Metrics
from mlx_cache_server.serving.served_model import model_pool
from mlx_cache_server.settings import Settings
from tests.helpers import wait_until
from tests.live import LiveServer
from tests.tiny_model import build_tiny_model

SMALL = {"working_memory": 1 << 20, "cache_max_bytes": 4 << 20}  # so a budget holds one
QUESTIONS = ["What is two plus two?", "Name a colour.", "Say hello."]


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory) -> Path:
    """Another tiny model: other weights (other greedy outputs), a shorter context."""
    folder = Path(tmp_path_factory.mktemp("tiny-b"))
    return build_tiny_model(folder, seed=1, max_position_embeddings=2048)


def specs(a: Path, b: Path, **b_spec) -> list[ModelSpec]:
    return [ModelSpec("a", str(a)), ModelSpec("b", str(b), aliases=("bee",), **b_spec)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def serving_models(model_specs: list[ModelSpec], clock=time.monotonic, **settings):
    config = Settings(**settings)
    metrics = Metrics()
    pool = model_pool(config, model_specs, metrics, clock)
    for spec in model_specs:
        if spec.pinned:  # as the server starts them (and the first model, which tests leave)
            pool.open_now(spec.id)
    server = LiveServer(pool, config, metrics).start()
    try:
        yield server
    finally:
        server.stop()


def client(url: str, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def conversation(c: OpenAI, model: str, question: str) -> tuple[list[str], list[int]]:
    """Two greedy turns; the replies and each turn's cached tokens."""
    messages = [{"role": "user", "content": question}]
    replies, cached = [], []
    for follow_up in ("And then?", None):
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        replies.append(r.choices[0].message.content)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": follow_up},
            ]
    return replies, cached


def statuses(url: str) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(url + "/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def uncached(tiny_model_dir, second_model_dir):
    """Each model's own uncached replies: the reference every cached run must equal."""
    with serving_models(specs(tiny_model_dir, second_model_dir), no_cache=True) as live:
        c = client(live.url)
        yield {(m, q): conversation(c, m, q)[0] for m in ("a", "b") for q in QUESTIONS}


def test_requests_alternate_between_two_models_with_their_own_outputs_and_caches(
    tiny_model_dir, second_model_dir, uncached
):
    with serving_models(specs(tiny_model_dir, second_model_dir)) as live:
        c = client(live.url)
        assert statuses(live.url) == {"a": "unloaded", "b": "unloaded"}
        for q in QUESTIONS:
            for model in ("a", "bee"):
                replies, cached = conversation(c, model, q)
                name = "b" if model == "bee" else model
                assert replies == uncached[(name, q)], (model, q)
                assert cached[1] > 0  # the second turn reused the first, in its model's cache
        assert uncached[("a", QUESTIONS[0])] != uncached[("b", QUESTIONS[0])]
        for model in ("a", "b"):
            stats = httpx.get(live.url + "/v1/cache", params={"model": model}).json()
            assert stats["model"] == model and stats["loaded"]
            assert [m["model"] for m in stats["models"]] == [model]
            assert stats["models"][0]["tokens_reused"] > 0
        assert statuses(live.url) == {"a": "loaded", "b": "loaded"}


def test_a_budget_for_one_model_unloads_and_reloads_as_requests_alternate(
    tiny_model_dir, second_model_dir, uncached
):
    model_specs = specs(tiny_model_dir, second_model_dir)
    with serving_models(model_specs, **SMALL) as probe:  # what each counts, unloaded
        sizes = {
            m["id"]: m["memory_bytes"] for m in client(probe.url).models.list().model_dump()["data"]
        }
    budget = max(sizes.values()) * 3 // 2
    with serving_models(model_specs, memory_budget=budget, **SMALL) as live:
        c = client(live.url)
        for q in QUESTIONS[:2]:
            for model in ("a", "b"):
                assert conversation(c, model, q)[0] == uncached[(model, q)], (model, q)
                assert statuses(live.url)[model] == "loaded"
                assert list(statuses(live.url).values()).count("loaded") == 1
        from prometheus_client.parser import text_string_to_metric_families

        samples = {
            (s.name, s.labels.get("model")): s.value
            for family in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)
            for s in family.samples
        }
        assert samples[("mlx_model_loads_total", "a")] == 2
        assert samples[("mlx_model_unloads_total", "a")] == 2
        assert samples[("mlx_model_loads_total", "b")] == 2
        assert samples[("mlx_model_loaded", "b")] == 1 and samples[("mlx_model_loaded", "a")] == 0
        assert samples[("mlx_memory_budget_bytes", None)] == budget


def test_a_model_is_never_unloaded_under_a_running_stream(tiny_model_dir, second_model_dir):
    model_specs = specs(tiny_model_dir, second_model_dir)
    with serving_models(model_specs, **SMALL) as probe:
        sizes = [m["memory_bytes"] for m in httpx.get(probe.url + "/v1/models").json()["data"]]
    with serving_models(model_specs, memory_budget=max(sizes) * 3 // 2, **SMALL) as live:
        c = client(live.url)
        stream = c.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=300,
            temperature=0,
            logit_bias={"99": -100},  # 99: <|im_end|>: the stream runs its 300 tokens
            stream=True,
        )
        chunks = iter(stream)
        first = next(chunks)  # a is loaded and streaming; its client reads no further yet
        answer: list = []
        other = threading.Thread(
            target=lambda: answer.append(conversation(c, "b", QUESTIONS[0])), daemon=True
        )
        other.start()
        wait_until(lambda: statuses(live.url)["b"] == "loading", seconds=30)
        assert statuses(live.url)["a"] == "loaded"  # b waits for a's room
        rest = list(chunks)
        text = (first.choices[0].delta.content or "") + "".join(
            ch.choices[0].delta.content or "" for ch in rest if ch.choices
        )
        assert rest[-1].choices[0].finish_reason == "length" and len(text) > 0
        other.join(60)
        assert answer and statuses(live.url) == {"a": "unloaded", "b": "loaded"}


def test_an_idle_model_is_unloaded_after_its_ttl_on_the_servers_clock(
    tiny_model_dir, second_model_dir
):
    clock = Clock()
    with serving_models(specs(tiny_model_dir, second_model_dir, ttl=60), clock) as live:
        c = client(live.url)
        conversation(c, "a", QUESTIONS[0])
        conversation(c, "b", QUESTIONS[0])
        clock.now += 59
        time.sleep(1.5)  # a sweep or more passes: not idle long enough yet
        assert statuses(live.url) == {"a": "loaded", "b": "loaded"}
        clock.now += 2
        wait_until(lambda: statuses(live.url)["b"] == "unloaded", seconds=10)
        assert statuses(live.url)["a"] == "loaded"  # no ttl: it stays
        assert conversation(c, "b", QUESTIONS[0])[0]  # and b loads again on use


def test_the_model_list_and_the_admin_load_and_unload(tiny_model_dir, second_model_dir):
    model_specs = [ModelSpec("a", str(tiny_model_dir), pinned=True), *specs(
        tiny_model_dir, second_model_dir)[1:]]  # fmt: skip
    with serving_models(model_specs, api_keys=["k"], admin_key="adm") as live:
        models = {m.id: m.model_extra for m in client(live.url, "k").models.list().data}
        assert models["b"] == {
            "type": "chat",
            "status": "unloaded", "loaded": False, "context_length": 2048, "aliases": ["bee"],
            "pinned": False, "ttl": None, "memory_bytes": models["b"]["memory_bytes"],
        }  # fmt: skip
        assert models["a"]["context_length"] == 4096 and "default" in models["a"]["aliases"]
        assert client(live.url, "k").models.retrieve("bee").id == "b"

        def post(path: str, key: str) -> httpx.Response:
            return httpx.post(live.url + path, headers={"Authorization": f"Bearer {key}"})

        assert post("/v1/models/b/load", "k").status_code == 401  # a tenant's key is not enough
        loaded = post("/v1/models/bee/load", "adm")
        assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
        assert client(live.url, "k").models.retrieve("b").model_extra["loaded"] is True
        listed = client(live.url, "k").models.list().data
        assert {m.id: m.model_extra["status"] for m in listed} == {"a": "loaded", "b": "loaded"}
        assert httpx.get(live.url + "/health").json()["models"] == {}  # not for keyless eyes
        unloaded = post("/v1/models/b/unload", "adm")
        assert unloaded.status_code == 200 and unloaded.json()["loaded"] is False
        pinned = post("/v1/models/a/unload", "adm")
        assert pinned.status_code == 409 and "pinned" in pinned.json()["error"]["message"]
        assert post("/v1/models/nope/load", "adm").status_code == 404
        with pytest.raises(Exception) as e:
            client(live.url, "k").chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert getattr(e.value, "status_code", None) == 404 and "a, b" in str(e.value)


TEMPLATE_SWITCH = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}"
)


def test_a_models_template_variables_apply_to_its_requests(tmp_path):
    # A thinking vocabulary: mlx-lm then leaves enable_thinking on unless told otherwise.
    folder = build_tiny_model(tmp_path / "switch", chat_template=TEMPLATE_SWITCH, thinking=True)
    model_specs = [
        ModelSpec("thinks", str(folder)),
        ModelSpec(
            "fast", str(folder), overrides={"chat_template_kwargs": {"enable_thinking": False}}
        ),
    ]
    with serving_models(model_specs) as live:
        c = client(live.url)
        sent = [{"role": "user", "content": "hi"}]
        usage = {
            m: c.chat.completions.create(model=m, messages=sent, max_tokens=1).usage.prompt_tokens
            for m in ("thinks", "fast")
        }
        assert usage["thinks"] - usage["fast"] == 2  # <think> (one special token) and "\n"
        import anthropic

        counted = anthropic.Anthropic(base_url=live.url, api_key="x").messages.count_tokens(
            model="fast", messages=sent
        )
        assert counted.input_tokens == usage["fast"]  # counted as it is rendered


def test_the_command_line_serves_every_model_flag_the_first_loaded_at_start(
    tiny_model_dir, second_model_dir
):
    from tests.live import start_server

    proc, url = start_server(tiny_model_dir, "--model", str(second_model_dir), "--model-ttl", "600")
    try:
        models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert models["tiny"]["status"] == "loaded"  # the first: --served-model-name names it
        other = second_model_dir.name
        assert models[other]["status"] == "unloaded" and models[other]["ttl"] == 600
        r = client(url).chat.completions.create(
            model=other, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert r.model == other and statuses(url)[other] == "loaded"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and f"model {other}: unloaded" in out, out


def test_anthropic_and_responses_requests_name_their_model_too(tiny_model_dir, second_model_dir):
    import anthropic

    with serving_models(specs(tiny_model_dir, second_model_dir)) as live:
        messages = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
        hello = [{"role": "user", "content": "hi"}]
        assert messages.messages.create(model="bee", messages=hello, max_tokens=2).model == "bee"
        assert statuses(live.url) == {"a": "unloaded", "b": "loaded"}
        # Claude Code sends Claude's names: they mean the default model.
        messages.messages.create(model="claude-opus-4-7", messages=hello, max_tokens=2)
        assert statuses(live.url)["a"] == "loaded"
        with pytest.raises(anthropic.NotFoundError):
            messages.messages.create(model="gpt-5", messages=hello, max_tokens=2)
        r = client(live.url).responses.create(model="b", input="hi", max_output_tokens=2)
        assert r.model == "b" and r.usage.input_tokens > 0


def test_a_gguf_file_in_the_models_is_imported_once_and_served(tmp_path, monkeypatch):
    from mlx_cache_server.models.default_model import gguf_target
    from tests.e2e.test_gguf import write_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "little.gguf"
    write_gguf(gguf)
    model_specs = [ModelSpec("little", str(gguf))]
    for run in range(2):  # a second server start finds the import done
        with serving_models(model_specs) as live:
            r = client(live.url).completions.create(model="little", prompt="ab", max_tokens=3)
            assert r.usage.completion_tokens > 0
            stamp = (gguf_target(gguf) / "model.safetensors").stat().st_mtime_ns
            if run == 0:
                first = stamp
    assert stamp == first  # imported once: the folder was not written again


def test_an_unloaded_models_arrays_are_freed(tiny_model_dir, second_model_dir):
    import weakref

    with serving_models(specs(tiny_model_dir, second_model_dir), admin_key="adm") as live:
        conversation(client(live.url), "b", QUESTIONS[0])
        weights = weakref.ref(live.pool.get("b").engine.model.parameters()["lm_head"]["weight"])
        assert weights() is not None
        r = httpx.post(live.url + "/v1/models/b/unload", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200
        assert weights() is None  # freed by the unload itself, not by some later collection


def test_an_unloaded_models_conversations_come_back_from_the_disk_tier(
    tiny_model_dir, second_model_dir, tmp_path
):
    with serving_models(
        specs(tiny_model_dir, second_model_dir), admin_key="adm", cache_dir=str(tmp_path)
    ) as live:
        c = client(live.url)
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        first = c.chat.completions.create(model="b", messages=messages, max_tokens=8)
        r = httpx.post(live.url + "/v1/models/b/unload", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and statuses(live.url)["b"] == "unloaded"
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ]
        again = c.chat.completions.create(model="b", messages=messages, max_tokens=8)
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        admin = {"Authorization": "Bearer adm"}
        disk = httpx.get(live.url + "/v1/cache", params={"model": "b"}, headers=admin).json()
        assert disk["models"][0]["disk_hits"] == 1


def test_a_busy_model_is_not_unloaded_and_one_that_cannot_fit_is_a_400(
    tiny_model_dir, second_model_dir
):
    model_specs = specs(tiny_model_dir, second_model_dir)
    with serving_models(model_specs, **SMALL) as probe:
        sizes = {
            m["id"]: m["memory_bytes"] for m in httpx.get(probe.url + "/v1/models").json()["data"]
        }
    too_small = [ModelSpec("a", str(tiny_model_dir), pinned=True), model_specs[1]]
    with serving_models(too_small, memory_budget=sizes["a"] + sizes["b"] // 2, **SMALL) as live:
        c = client(live.url)
        with pytest.raises(openai.BadRequestError) as e:  # not a 503: SDKs would retry it
            c.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "model_too_large" and "cannot fit" in str(e.value)
        assert e.value.body["param"] == "model" and e.value.body["type"] == "invalid_request_error"
        assert "retry-after" not in e.value.response.headers  # waiting will not help
        admin = httpx.post(live.url + "/v1/models/b/load")
        assert admin.status_code == 400 and admin.json()["error"]["code"] == "model_too_large"
    with serving_models(model_specs, **SMALL) as live:
        stream = client(live.url).chat.completions.create(
            model="b", messages=[{"role": "user", "content": "Count."}], max_tokens=300,
            logit_bias={"99": -100}, stream=True,
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        busy = httpx.post(live.url + "/v1/models/b/unload")
        assert busy.status_code == 409 and "requests running" in busy.json()["error"]["message"]
        assert list(chunks)[-1].choices[0].finish_reason == "length"  # and it ran to its end


def test_two_ids_on_the_same_weights_each_have_a_disk_tier(tiny_model_dir, tmp_path):
    same = [ModelSpec("x", str(tiny_model_dir)), ModelSpec("y", str(tiny_model_dir))]
    with serving_models(same, cache_dir=str(tmp_path)) as live:
        c = client(live.url)
        folders = set()
        for model in ("x", "y"):
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            disk = httpx.get(live.url + "/v1/cache", params={"model": model}).json()["disk"]
            folders.add(disk["folder"])
        assert len(folders) == 2
