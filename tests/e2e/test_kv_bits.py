"""Quantized KV (`--kv-bits`): the cache holds it, reuses it, keeps it on disk; greedy output
with the cache equals output without it at the same bits."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from mlx_cache_server.engine import SamplingParams
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.helpers import wait_until
from tests.live import serving, start_server

SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 4}
QUANTIZED = {"kv_bits": 8, "kv_group_size": 32}


@pytest.fixture(scope="module")
def model_dir(tiny_kv_model_dir) -> Path:
    return tiny_kv_model_dir


@pytest.fixture(scope="module")
def uncached(model_dir):
    with serving(str(model_dir), served_model_name="tiny", no_cache=True, **QUANTIZED) as live:
        yield live


def chat(url: str, messages: list, max_tokens: int = 12) -> tuple[str, object]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage


def conversation(url: str, name: str, questions: list[str], out: dict) -> None:
    messages = [{"role": "system", "content": f"{name}. " + SYSTEM["content"]}]
    for q in questions:
        messages.append({"role": "user", "content": q})
        text, usage = chat(url, messages)
        messages.append({"role": "assistant", "content": text})
        out.setdefault(name, []).append((list(messages), usage))


def test_concurrent_chats_reuse_quantized_kv_and_match_the_uncached_server(model_dir, uncached):
    questions = ["Hello.", "Tell me more.", "And then?"]
    out: dict = {}
    with serving(str(model_dir), served_model_name="tiny", **QUANTIZED) as live:
        threads = [
            threading.Thread(target=conversation, args=(live.url, f"Chat {i}", questions, out))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(out) == ["Chat 0", "Chat 1", "Chat 2"]
    for turns in out.values():
        previous = None
        for messages, usage in turns:
            if previous is not None:  # the previous turn's prompt and reply were reused
                cached = usage.prompt_tokens_details.cached_tokens
                assert cached >= previous.prompt_tokens + previous.completion_tokens - 1
            previous = usage
            assert chat(uncached.url, messages[:-1])[0] == messages[-1]["content"]


def test_quantized_kv_takes_a_fraction_of_the_bytes(model_dir):
    tokens = list(range(40, 90)) * 8
    sizes = {}
    for bits in (None, 8, 4):
        engine = build_engine(Settings(kv_bits=bits, kv_group_size=32), str(model_dir))
        engine.start()
        try:
            events: list = []
            engine.submit(tokens, SamplingParams(max_tokens=1, temperature=0.0), events.append)
            wait_until(lambda events=events: any(type(e).__name__ == "Finished" for e in events))
        finally:
            engine.stop()  # the insert follows the Finished event on the engine's thread
        sizes[bits] = engine.cache.nbytes
    # float32 KV against 8 and 4 bits plus a float32 scale and bias per group of 32.
    assert sizes[8] == pytest.approx(sizes[None] * 40 / 128, rel=0.02)
    assert sizes[4] == pytest.approx(sizes[None] * 24 / 128, rel=0.02)


def test_quantized_kv_survives_a_restart_and_never_mixes_with_full_precision(
    model_dir, uncached, tmp_path
):
    flags = ("--cache-dir", str(tmp_path), "--shutdown-grace", "10")
    quantized = ("--kv-bits", "8", "--kv-group-size", "32")
    messages = [SYSTEM]
    proc, url = start_server(model_dir, *flags, *quantized)
    try:
        for q in ("Hello.", "Tell me more."):
            messages.append({"role": "user", "content": q})
            text, last = chat(url, messages)
            messages.append({"role": "assistant", "content": text})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # Full precision on the same folder: another fingerprint, nothing reused.
        proc, url = start_server(model_dir, *flags)
        messages.append({"role": "user", "content": "Go on."})
        assert chat(url, messages)[1].prompt_tokens_details.cached_tokens == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        proc, url = start_server(model_dir, *flags, *quantized)
        text, usage = chat(url, messages)
        report = httpx.get(url + "/v1/cache").json()
    finally:
        proc.kill()
    reused = usage.prompt_tokens_details.cached_tokens
    assert reused >= last.prompt_tokens + last.completion_tokens - 1
    assert report["models"][0]["disk_hits"] == 1 and report["kv_bits"] == 8
    assert text == chat(uncached.url, messages)[0]
    tiers = [p for p in tmp_path.iterdir() if (p / "index.sqlite").is_file()]
    assert len(tiers) == 2  # one folder per fingerprint (beside them: stored responses)


@pytest.mark.parametrize(
    ("bits", "group", "message"),
    [(7, 32, "--kv-bits must be one of"), (8, 48, "--kv-group-size must be one of"),
     (8, 128, "Try another --kv-group-size")],
)  # fmt: skip
def test_a_quantization_the_model_cannot_take_stops_the_start(model_dir, bits, group, message):
    with pytest.raises(ValueError, match=message):
        build_engine(Settings(kv_bits=bits, kv_group_size=group), str(model_dir))


def test_a_stream_broken_off_stops_and_leaves_its_kv_for_the_next_request(model_dir):
    messages = [SYSTEM, {"role": "user", "content": "Count to a thousand."}]
    no_end = {"99": -100}  # <|im_end|>: the reply runs to max_tokens unless broken off
    with serving(str(model_dir), served_model_name="tiny", **QUANTIZED) as live:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3000, temperature=0,
            logit_bias=no_end, stream=True,
        )  # fmt: skip
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
        wait_until(lambda: live.engine.stats.cancelled == 1 and live.engine.running == 0)
        assert live.engine.stats.finished == 0
        _, usage = chat(live.url, messages)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
