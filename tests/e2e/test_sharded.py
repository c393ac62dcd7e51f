"""One model sharded over two processes under `mlx.launch` (ring backend, loopback), through
the openai SDK: what it answers equals what one process answers, token for token."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.live import free_port, free_port_run, serving
from tests.tiny_model import build_tiny_model

LAUNCH = Path(sys.executable).parent / "mlx.launch"
NO_END = {"logit_bias": {"99": -100}}  # <|im_end|> of the tiny tokenizer: generate to the limit
QUESTIONS = ["Hello there, who are you?", "And then what?", "Tell me more.", "Why so?"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama splits by heads only; qwen2 by layers too, here 3 of them, so the two ranks'
    shards (2 layers and 1) and their caches' bytes differ."""
    root = tmp_path_factory.mktemp("sharded")
    return {
        "tensor": build_tiny_model(root / "llama"),
        "pipeline": build_tiny_model(root / "qwen2", model_type="qwen2", num_hidden_layers=3),
    }


@contextmanager
def launched(model: Path, *flags: str, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """`mlx.launch -n 2 -- mlx-cache-server serve ...`, as a user starts it; its URL once
    rank 0 answers."""
    port = free_port()
    ring = free_port_run(2, {port})
    command = [
        str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(ring),
        "--python", sys.executable, "--", "-m", "mlx_cache_server", "serve", "--model", str(model),
        "--port", str(port), "--served-model-name", "tiny", *flags,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(c: OpenAI, questions: list[str] = QUESTIONS) -> list[tuple[str, int]]:
    """Greedy turns of one conversation: each reply and its cached tokens."""
    messages, out = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                      temperature=0)  # fmt: skip
        reply = r.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        out.append((reply, r.usage.prompt_tokens_details.cached_tokens))
    return out


def structured(c: OpenAI) -> str:
    r = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Where?"}],
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    )
    return r.choices[0].message.content


def letters_only(model: Path) -> dict[str, int]:
    """A logit bias that keeps sampling to the letters a to z: each is one token and reads
    back as it, so a sampled reply sent back is the same tokens, and the next turn reuses
    them from the cache (random tokens can decode to text that tokenizes otherwise)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return {str(vocab[c]): 100 for c in "abcdefghijklmnopqrstuvwxyz"}


def session(c: OpenAI, model: Path) -> tuple[str, list[tuple[str, int]], list[dict], str]:
    """A structured reply, a greedy conversation, and a sampled reply with a greedy turn
    after it: the messages of that turn and its reply."""
    json_reply, turns = structured(c), chat(c)
    messages = [{"role": "user", "content": "Go."}]
    bias = letters_only(model)
    sampled = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                        temperature=1.0, logit_bias=bias)  # fmt: skip
    assert sampled.usage.completion_tokens == 24
    messages += [
        {"role": "assistant", "content": sampled.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    after = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                      temperature=0)  # fmt: skip
    assert after.usage.prompt_tokens_details.cached_tokens > sampled.usage.prompt_tokens
    return json_reply, turns, messages, after.choices[0].message.content


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_a_sharded_chat_equals_one_process_token_for_token(models, mode, tmp_path):
    model = models[mode]
    with serving(str(model), served_model_name="tiny") as one:
        expected_json, expected, _, _ = session(client(one.url), model)
    assert json.loads(expected_json)["city"] in ("Paris", "Lyon")
    assert all(cached > 0 for _, cached in expected[1:])  # the turns did reuse the cache
    flags = ["--pipeline"] if mode == "pipeline" else []
    with launched(model, *flags, log=tmp_path / "launch.log") as (_, url):
        got_json, got, messages, after = session(client(url), model)
        assert httpx.get(url + "/health").json()["status"] == "ok"
    assert got_json == expected_json  # a grammar, built again on the other rank
    assert got == expected  # replies and cached tokens alike
    # The sampled reply had no seed: rank 0 drew one for every rank. Had each rank drawn
    # its own tokens, its shard of their KV, reused by the next turn, would not be theirs.
    with serving(str(model), served_model_name="tiny", no_cache=True) as one:
        c = client(one.url)
        reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                          temperature=0)  # fmt: skip
    assert after == reply.choices[0].message.content


def test_ranks_with_unequal_shards_evict_alike_under_a_byte_budget(models, tmp_path):
    """Rank 0 holds 2 of the 3 layers, rank 1 one: counted as their own bytes, the two
    caches would evict at different turns and their shards would run on different prefixes.
    A follower whose cache differs from rank 0's stops the server: it must keep serving."""
    model = models["pipeline"]
    conversations = [[f"Question {i}: what is {i} plus {i}?", "And then?"] for i in range(5)]
    with serving(str(model), served_model_name="tiny", no_cache=True) as one:
        expected = [[reply for reply, _ in chat(client(one.url), q)] for q in conversations]
    with launched(model, "--pipeline", "--cache-max-bytes", "60KiB",
                  log=tmp_path / "launch.log") as (_, url):  # fmt: skip
        c = client(url)
        got = [[reply for reply, _ in chat(c, q)] for q in conversations]
        report = httpx.get(url + "/v1/cache").json()
        assert httpx.get(url + "/health").json()["status"] == "ok"
    assert got == expected
    (stats,) = report["models"]
    assert stats["evictions"] + stats["shortened"] > 0, report  # the budget was reached
    assert stats["tokens_reused"] > 0, report  # and the second turns still reused the first


def test_a_rank_killed_mid_request_ends_in_errors_not_a_hang(models, tmp_path):
    log = tmp_path / "launch.log"
    flags = ["--shard-timeout", "5", "--shutdown-grace", "5"]
    with launched(models["tensor"], *flags, log=log) as (proc, url):
        (pid,) = re.findall(r"rank 1 of 2 \(pid (\d+)\)", log.read_text())
        c = client(url)
        stream = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Go on and on."}],
            max_tokens=3000, temperature=0, stream=True, **NO_END,
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)  # generating
        os.kill(int(pid), signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="sharded server failed"):
            for _ in chunks:  # ends with the server's error event
                assert time.monotonic() - started < 60, "still streaming after the rank died"
        proc.wait(60)  # every process ended (mlx.launch itself exits 0 whatever they did)
        assert "rank 0 ERROR mlx_cache_server: stopping" in log.read_text()


def test_heads_that_do_not_split_over_the_processes_stop_the_start(tmp_path):
    model = build_tiny_model(tmp_path / "one-kv-head", num_key_value_heads=1)
    port = free_port()
    ring = free_port_run(2, {port})
    command = [
        str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(ring),
        "--python", sys.executable, "--", "-m", "mlx_cache_server", "serve", "--model", str(model),
        "--port", str(port),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a regression that hangs leaves no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "1 KV heads per layer do not split over 2 processes" in out


def test_a_request_after_a_rank_died_while_idle_gets_an_error(models, tmp_path):
    """Rank 0 hands nothing over while idle: the first request after a peer died is the one
    that finds out, and must end in an error, not wait. The ranks are started by hand, as
    `mlx.launch` would, but without it: it would stop rank 0 itself as soon as rank 1 died."""
    hostfile = tmp_path / "hosts.json"
    port = free_port()
    ring = free_port_run(2, {port})
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
    command = [sys.executable, "-m", "mlx_cache_server", "serve", "--model", str(models["tensor"]),
               "--port", str(port), "--served-model-name", "tiny"]  # fmt: skip
    ranks = [
        subprocess.Popen(
            command,
            env=dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile)),
            stdout=(tmp_path / f"rank{rank}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert ranks[0].poll() is None, (tmp_path / "rank0.log").read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ranks[1].kill()
        ranks[1].wait()
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="sharded server failed") as failed:
            client(url).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello?"}], max_tokens=4
            )
        assert failed.value.status_code == 503
        # Told by the failed handover itself (about a second), not by a timeout: the request
        # timeout is 600 s, the shutdown grace 30 s, the shard timeout 60 s.
        assert time.monotonic() - started < 20
        assert ranks[0].wait(60) == 1  # it stopped by itself, saying it failed
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
