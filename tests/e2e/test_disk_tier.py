"""The disk tier through the `openai` SDK: across a restart, and under a RAM budget too small."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
from openai import OpenAI

from tests.helpers import wait_until
from tests.live import serving, start_server

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 6}


def chat(url: str, messages: list) -> tuple[str, object]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    return r.choices[0].message.content, r.usage


def turns(url: str, messages: list, questions: list[str]) -> list:
    out = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        text, usage = chat(url, messages)
        messages.append({"role": "assistant", "content": text})
        out.append((text, usage))
    return out


def test_a_conversation_continues_from_disk_after_a_restart(
    tiny_model_dir, uncached_server, tmp_path
):
    flags = ("--cache-dir", str(tmp_path), "--shutdown-grace", "10")
    proc, url = start_server(tiny_model_dir, *flags)
    messages = [SYSTEM]
    try:
        before = turns(url, messages, ["Hello.", "Tell me more.", "And then?"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stdout.read()
        proc, url = start_server(tiny_model_dir, *flags)
        ((text, usage),) = turns(url, messages, ["Go on."])
        report = httpx.get(url + "/v1/cache").json()
    finally:
        proc.kill()
    _, last = before[-1]
    # Turn 3's prompt and reply were written to disk and read back after the restart.
    assert (
        usage.prompt_tokens_details.cached_tokens >= last.prompt_tokens + last.completion_tokens - 1
    )
    assert report["models"][0]["disk_hits"] == 1 and report["disk"]["tokens_loaded"] > 0
    plain = [SYSTEM] + messages[1:-1]
    assert chat(uncached_server.url, plain)[0] == text


def test_every_follow_up_hits_with_ram_far_smaller_than_the_conversations(
    tiny_model_dir, uncached_server, tmp_path
):
    with serving(
        str(tiny_model_dir), served_model_name="tiny", cache_max_bytes=200_000,
        cache_dir=str(tmp_path),
    ) as live:  # fmt: skip
        disk, threads = live.engine.cache.disk, []
        load = disk.load

        def spy(*args):
            threads.append(threading.current_thread().name)
            return load(*args)

        disk.load = spy
        chats = [
            [{"role": "system", "content": f"Chat {i}. " + SYSTEM["content"]}] for i in range(4)
        ]
        seen = [None] * len(chats)
        for turn in range(3):
            for i, messages in enumerate(chats):  # round-robin: each evicts the others
                ((text, usage),) = turns(live.url, messages, [f"Question {turn}?"])
                if seen[i] is not None:
                    need = seen[i].prompt_tokens + seen[i].completion_tokens - 1
                    assert usage.prompt_tokens_details.cached_tokens >= need, (i, turn)
                seen[i] = usage
                live.engine.cache.disk.flush()
        stats = live.engine.cache.stats()
        report = httpx.get(live.url + "/v1/cache").json()
    assert stats.disk_hits >= 8 and stats.bytes <= 200_000
    # Read back off the engine's thread: the running generations never wait on the disk.
    assert threads and "mlx-engine" not in threads
    assert report["disk"]["bytes"] > report["bytes"]
    # Every write reached the disk: none was a slice of a RAM segment it could not write.
    assert report["disk"]["skipped"] == 0 and report["disk"]["writes"] > 0
    for messages in chats:  # the same replies as a server with no cache at all
        assert chat(uncached_server.url, messages[:-1])[0] == messages[-1]["content"]


def test_a_cache_dir_that_cannot_be_written_is_one_warning_and_serving_goes_on(
    tiny_model_dir, tmp_path
):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    proc, url = start_server(tiny_model_dir, "--cache-dir", str(not_a_folder))
    try:
        assert chat(url, [SYSTEM, {"role": "user", "content": "Hi."}])[0] is not None
        assert httpx.get(url + "/v1/cache").json().get("disk") is None
    finally:
        proc.terminate()
        proc.wait(30)
    log = proc.stdout.read()
    assert "Traceback" not in log
    (line,) = [line for line in log.splitlines() if "disk tier off" in line]
    assert "cannot write to" in line and "serving from RAM alone" in line


def test_warm_prompts_are_cached_before_the_first_request(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps([{"messages": [SYSTEM]}, "Some plain text."]))
    shared = AutoTokenizer.from_pretrained(str(tiny_model_dir)).apply_chat_template([SYSTEM])
    flags = ("--warm-prompts", str(warm), "--api-key", "k", "--admin-key", "a")
    proc, url = start_server(tiny_model_dir, *flags)
    try:

        def inserts() -> int:
            report = httpx.get(url + "/v1/cache", headers={"authorization": "Bearer a"}).json()
            return sum(m["inserts"] for m in report["models"])

        wait_until(lambda: inserts() == 2)  # both prompts, in the one tenant's namespace
        client = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        ask = [SYSTEM, {"role": "user", "content": "Hi."}]
        r = client.chat.completions.create(model="tiny", messages=ask, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens >= len(shared)
    finally:
        proc.kill()


def test_an_unreadable_warm_prompts_file_stops_the_start_with_a_message(tiny_model_dir, tmp_path):
    bad = tmp_path / "warm.json"
    bad.write_text('{"not": "a list"}')
    done = subprocess.run(
        [sys.executable, "-m", "mlx_cache_server", "serve", "--model", str(tiny_model_dir),
         "--warm-prompts", str(bad)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "expected a JSON list" in done.stderr


def test_a_stored_file_whose_header_was_edited_is_recomputed_not_served(
    tiny_model_dir, uncached_server, tmp_path
):
    """A same-size edit of each stored file's first dtype (the arrays' bytes then read as
    another type) passes no checksum: after a restart the prompt is recomputed, its greedy
    reply is the uncached one, and the server stays up."""
    import re

    settings = {"served_model_name": "tiny", "cache_dir": str(tmp_path)}
    messages = [SYSTEM, {"role": "user", "content": "Hello."}]
    with serving(str(tiny_model_dir), **settings) as live:
        chat(live.url, messages)
        live.engine.cache.disk.flush()
    other = {b'"F32"': b'"I32"', b'"F16"': b'"I16"', b'"BF16"': b'"I16" '}  # same size, JSON
    files = list(tmp_path.glob("*/*.safetensors"))
    assert files
    for path in files:
        data = path.read_bytes()
        m = re.search(rb'"dtype":("\w+")', data)
        path.write_bytes(data[: m.start(1)] + other[m.group(1)] + data[m.end(1) :])
    with serving(str(tiny_model_dir), **settings) as live:
        text, usage = chat(live.url, messages)
        assert httpx.get(live.url + "/health").status_code == 200
        disk = live.engine.cache.disk.stats
    assert text == chat(uncached_server.url, messages)[0]
    assert not usage.prompt_tokens_details or not usage.prompt_tokens_details.cached_tokens
    assert disk.dropped >= 1
