"""The disk tier through the `openai` SDK: across a restart, and under a RAM budget too small."""

from __future__ import annotations

import signal

import httpx
from openai import OpenAI

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
    assert report["disk"]["hits"] == 1 and report["models"][0]["disk_hits"] == 1
    plain = [SYSTEM] + messages[1:-1]
    assert chat(uncached_server.url, plain)[0] == text


def test_every_follow_up_hits_with_ram_far_smaller_than_the_conversations(
    tiny_model_dir, uncached_server, tmp_path
):
    with serving(
        str(tiny_model_dir), served_model_name="tiny", cache_max_bytes=200_000,
        cache_dir=str(tmp_path),
    ) as live:  # fmt: skip
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
    assert report["disk"]["bytes"] > report["bytes"]
    for messages in chats:  # the same replies as a server with no cache at all
        assert chat(uncached_server.url, messages[:-1])[0] == messages[-1]["content"]
