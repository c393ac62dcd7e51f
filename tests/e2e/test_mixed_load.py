"""A running stream keeps getting tokens while a long prompt prefills beside it."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import mlx.core as mx
import pytest
from openai import OpenAI

from mlx_cache_server.engine import Delta, Failed, Finished, SamplingParams, Started, placement
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.helpers import ended, wait_until


def test_a_long_prompt_prefills_in_chunks_between_the_running_streams_tokens(tiny_model_dir):
    # A gap too short for any prefill: every step prefills the smallest chunk.
    engine = build_engine(Settings(no_cache=True, decode_gap=1e-9), str(tiny_model_dir))
    log: list[tuple[str, Any]] = []  # every event of both requests, in the order they came
    lock = threading.Lock()

    def sink(name: str):
        def emit(event: Any) -> None:
            with lock:
                log.append((name, event))

        return emit

    tokens = engine.tokenizer.encode("Tell me a long story about the sea. ")
    long_prompt = (tokens * 200)[:2000]
    engine.start()
    try:
        no_end = {t: -100.0 for t in engine.tokenizer.eos_token_ids}  # decode to the limit
        params = SamplingParams(max_tokens=2000, temperature=0.0, logit_bias=no_end)
        engine.submit(tokens, params, sink("running"))
        wait_until(lambda: sum(1 for n, e in log if n == "running" and isinstance(e, Delta)) > 3)
        # Greedy and one token: a sampled token can be part of a character, which sends no
        # Delta; its Finished still comes with the step that made it.
        engine.submit(long_prompt, SamplingParams(max_tokens=1, temperature=0.0), sink("long"))
        wait_until(lambda: ended([e for n, e in log if n == "long"]))
    finally:
        engine.stop()
    order = [(n, type(e)) for n, e in log]
    started = order.index(("long", Started))
    first = next(i for i, (n, kind) in enumerate(order) if n == "long" and kind is not Started)
    between = [n for n, kind in order[started:first] if kind is Delta]
    chunks = -(-len(long_prompt) // engine.min_prefill_chunk)
    # The running stream got a token with every chunk of the long prompt's prefill, and the
    # long prompt's first token came with its last chunk's step: not after a one-token step
    # for its last token and the step that joins it to the running stream's batch.
    assert chunks - 1 <= between.count("running") <= chunks
    assert ("running", Finished) not in order[:first]


def test_openai_streams_keep_alive_with_comments_the_sdks_skip(server, monkeypatch):
    import mlx_cache_server.serving.responses as responses_api
    import mlx_cache_server.serving.sse as sse

    monkeypatch.setattr(sse, "KEEP_ALIVE_EVERY", 0.0005)
    monkeypatch.setattr(responses_api, "KEEP_ALIVE_EVERY", 0.0005)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Say hello."}]
    for path, body in (
        ("/v1/chat/completions", {"messages": ask, "max_tokens": 30}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 30}),
        ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 30}),
    ):
        body = {"model": "tiny", "stream": True, "temperature": 0, **body}
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert ": keep-alive" in lines, path
        assert (
            lines[-1] == "data: [DONE]"
            or "response.completed" in lines[-1]
            or ("response.incomplete" in lines[-1])
        )
    with client.chat.completions.create(
        model="tiny", messages=ask, max_tokens=30, temperature=0, stream=True
    ) as stream:
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=ask, max_tokens=30, temperature=0)
    assert streamed == whole.choices[0].message.content


def recorded_passes(engine: Any) -> list[tuple[int, ...]]:
    """Each forward pass's input shape (sequences, tokens) from now on, in order: the
    engine's model wrapped, before the engine starts."""
    shapes: list[tuple[int, ...]] = []
    model = engine.model

    class Counting:
        def __call__(self, inputs, *args, **kwargs):
            shapes.append(tuple(inputs.shape))
            return model(inputs, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    engine.model = Counting()
    return shapes


def test_prompts_prefilled_together_beside_a_stream_share_one_steps_budget(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True, decode_gap=1e-9), str(tiny_model_dir))
    shapes = recorded_passes(engine)
    tokens = engine.tokenizer.encode("Tell me a long story about the sea. ")
    no_end = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    sinks: list[list[Any]] = [[] for _ in range(4)]
    engine.start()
    try:
        engine.submit(tokens, SamplingParams(max_tokens=3000, logit_bias=no_end), sinks[0].append)
        wait_until(lambda: sum(isinstance(e, Delta) for e in sinks[0]) > 3)
        shapes.clear()
        for i, sink in enumerate(sinks[1:]):  # three long prompts at once
            engine.submit(((tokens * 100)[i:])[:900], SamplingParams(max_tokens=1), sink.append)
        wait_until(lambda: all(ended(s) for s in sinks[1:]))
    finally:
        engine.stop()
    prefills = [b * t for b, t in shapes if t > 1]
    assert sum(prefills) >= 3 * 899  # all three were prefilled in these passes
    assert max(prefills) <= engine.min_prefill_chunk  # together, within one step's least


def running_stream(tiny_model_dir: Any) -> tuple[Any, list[int], list[Any]]:
    """A started engine (no cache, every prefill step its smallest) with one stream
    decoding; the stream's prompt and its events so far."""
    engine = build_engine(Settings(no_cache=True, decode_gap=1e-9), str(tiny_model_dir))
    tokens = engine.tokenizer.encode("Tell me a long story about the sea. ")
    no_end = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    running: list[Any] = []
    engine.start()
    try:
        engine.submit(tokens, SamplingParams(max_tokens=3000, logit_bias=no_end), running.append)
        wait_until(lambda: sum(isinstance(e, Delta) for e in running) > 3)
    except BaseException:
        engine.stop()
        raise
    return engine, tokens, running


def test_a_failing_last_chunk_fails_its_prompt_only(tiny_model_dir, monkeypatch, caplog):
    import mlx_cache_server.engine.prompts as batch_module  # where the batch prefills a lone prompt

    long: list[Any] = []
    engine, tokens, running = running_stream(tiny_model_dir)
    try:

        def broken(*args: Any, **kwargs: Any) -> Any:  # the long prompt's last chunk only
            raise RuntimeError("out of memory (simulated)")

        monkeypatch.setattr(batch_module, "prefill_alone", broken)
        engine.submit((tokens * 20)[:300], SamplingParams(max_tokens=4), long.append)
        wait_until(lambda: ended(long))
        after = len(running)
        wait_until(lambda: len(running) > after + 3)  # the stream runs on
        failed = engine.stats.failed  # (stopping the engine fails the stream)
    finally:
        engine.stop()
    assert any(isinstance(e, Failed) for e in long) and not any(isinstance(e, Delta) for e in long)
    assert not ended(running[:after])
    assert failed == 1 and "simulated" in caplog.text
    assert "finishing a prompt's prefill failed" in caplog.text  # there, not at its admission


def test_a_long_prompt_beside_short_streams_decodes_in_a_batch_of_its_own(tiny_model_dir):
    engine = build_engine(Settings(decode_gap=1e-9), str(tiny_model_dir))
    shapes = recorded_passes(engine)
    tokenizer = engine.tokenizer
    no_end = {t: -100.0 for t in tokenizer.eos_token_ids}
    long_prompt = (tokenizer.encode("Tell me a long story about the sea. ") * 40)[:400]
    params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=no_end)
    streams: list[list[Any]] = [[] for _ in range(3)]
    beside: list[Any] = []
    alone: list[Any] = []
    again: list[Any] = []
    engine.start()
    try:
        running = []
        for i, sink in enumerate(streams):
            stream = tokenizer.encode(f"Stream {i}: a story.")
            limit = SamplingParams(max_tokens=3000, logit_bias=no_end)
            running.append(engine.submit(stream, limit, sink.append))
            wait_until(lambda sink=sink: sum(isinstance(e, Delta) for e in sink) > 2)
        shapes.clear()
        engine.submit(long_prompt, params, beside.append)
        wait_until(lambda: ended(beside))
        during = list(shapes)
        streamed = [sum(isinstance(e, Delta) for e in s) for s in streams]
        wait_until(lambda: all(sum(isinstance(e, Delta) for e in s) > n + 2
                               for s, n in zip(streams, streamed, strict=True)))  # fmt: skip
        for request in running:
            request.cancel()
        wait_until(lambda: all(ended(s) for s in streams))
        engine.submit(long_prompt, params, again.append)  # from the cache
        wait_until(lambda: ended(again))
    finally:
        engine.stop()
    solo = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    solo.start()
    try:
        solo.submit(long_prompt, params, alone.append)  # the only sequence: the main batch
        wait_until(lambda: ended(alone))
    finally:
        solo.stop()
    decode = [b for b, t in during if t == 1]
    # Its tokens after the first came from passes of its own, beside the streams' passes
    # of three: the streams' batch was never padded to its length.
    assert decode.count(1) >= 5 and decode.count(3) >= 5
    assert 4 not in decode
    assert not any(ended(s) for s in (streams[0][:-1], streams[1][:-1], streams[2][:-1]))
    assert text(beside) == text(alone) == text(again) and len(text(alone)) > 0
    assert next(e for e in again if isinstance(e, Started)).cached_tokens >= len(long_prompt) - 1


def test_a_prompt_with_nothing_cached_taken_out_for_its_last_chunk_keeps_its_free_slots(
    tiny_model_dir, monkeypatch
):
    import mlx_cache_server.engine.prompts as prompts  # where the batch takes a prompt out

    taken: list[tuple[int, int]] = []  # (slots in its buffer, tokens held) per layer 0
    take_out = prompts.PromptSteps.take_out

    def recorded(self: Any, request: Any) -> Any:
        cache, tokens = take_out(self, request)
        taken.append((cache[0].keys.shape[2], cache[0].offset))
        return cache, tokens

    monkeypatch.setattr(prompts.PromptSteps, "take_out", recorded)
    long: list[Any] = []
    engine, tokens, _ = running_stream(tiny_model_dir)
    try:
        engine.submit((tokens * 20)[:300], SamplingParams(max_tokens=2), long.append)
        wait_until(lambda: ended(long))
    finally:
        engine.stop()
    # The room its buffer has (mlx-lm grows it 256 slots at a time) came along: its last
    # chunk goes there, not into a copy cut to its length and grown again.
    ((slots, held),) = taken
    assert held < slots
    assert isinstance(long[-1], Finished)


@pytest.mark.parametrize("how", ["cancelled", "failing"])
def test_a_sequence_on_the_side_that_is_cancelled_or_fails_ends_alone(
    tiny_model_dir, how, monkeypatch
):
    import mlx_cache_server.engine.batch as batch_module
    import mlx_cache_server.engine.running as running  # where the batch places a sequence

    placed: list[int] = []

    def place(*args: Any) -> int:
        placed.append(placement.place(*args))
        return placed[-1]

    stored: list[int] = []  # tokens of each KV the batch put into the cache
    import mlx_cache_server.engine.exits as exits  # where the batch stores a sequence's KV

    store = exits.store

    def storing(engine: Any, request: Any, state: Any) -> None:
        stored.append(len(state[1]) if state else 0)
        store(engine, request, state)

    batches: list[Any] = []
    new_batch = batch_module.Batch.__init__

    def recorded(self: Any, *args: Any) -> None:
        new_batch(self, *args)
        batches.append(self)

    monkeypatch.setattr(running, "place", place)
    monkeypatch.setattr(exits, "store", storing)
    monkeypatch.setattr(batch_module.Batch, "__init__", recorded)
    engine = build_engine(Settings(decode_gap=1e-9), str(tiny_model_dir))
    tokenizer = engine.tokenizer
    no_end = {t: -100.0 for t in tokenizer.eos_token_ids}
    long_prompt = (tokenizer.encode("Tell me a long story about the sea. ") * 40)[:400]
    calls = []

    def breaks_at_its_third_token(context: mx.array, logits: mx.array) -> mx.array:
        calls.append(1)  # the first token's sampling, then each on the side batch
        if len(calls) >= 3:
            raise ValueError("a broken processor (simulated)")
        return logits

    constraint = breaks_at_its_third_token if how == "failing" else None
    params = SamplingParams(max_tokens=3000, logit_bias=no_end, constraint=constraint)
    streams: list[list[Any]] = [[] for _ in range(3)]
    long: list[Any] = []
    again: list[Any] = []
    engine.start()
    try:
        for i, sink in enumerate(streams):
            stream = tokenizer.encode(f"Stream {i}: a story.")
            limit = SamplingParams(max_tokens=3000, logit_bias=no_end)
            engine.submit(stream, limit, sink.append)
            wait_until(lambda sink=sink: sum(isinstance(e, Delta) for e in sink) > 2)
        request = engine.submit(long_prompt, params, long.append)
        wait_until(lambda: sum(isinstance(e, Delta) for e in long) >= 2 or ended(long))
        request.cancel()
        wait_until(lambda: ended(long))
        decoded = sum(isinstance(e, Delta) for e in long)
        streamed = [len(s) for s in streams]
        wait_until(lambda: all(len(s) > n + 3 for s, n in zip(streams, streamed, strict=True)))
        engine.submit(long_prompt, SamplingParams(max_tokens=1), again.append)
        wait_until(lambda: ended(again))
        assert not any(ended(s) for s in streams)
        assert batches[-1].running.side.prompt_cache_nbytes == 0  # it left the side batch too
    finally:
        engine.stop()
    assert placed.count(placement.SIDE) == 1  # the long prompt, and only it
    end = long[-1]
    if how == "cancelled":
        assert isinstance(end, Finished) and end.reason == "cancelled"
        # What it decoded on the side was cached as it left, beyond its prompt.
        assert decoded >= 2 and max(stored) >= len(long_prompt) + decoded - 1
    else:
        assert isinstance(end, Failed) and "Sampling failed" in end.message
    assert next(e for e in again if isinstance(e, Started)).cached_tokens == len(long_prompt) - 1


def text(sink: list[Any]) -> str:
    return "".join(e.text for e in sink if isinstance(e, Delta))


def test_a_long_prompts_chunks_run_in_the_streams_pass_and_change_no_output(
    tiny_model_dir, monkeypatch
):
    import mlx_cache_server.engine.generator as generator

    together: list[list[tuple[int, ...]]] = []  # each pass run together: its parts' shapes
    forward_together = generator.forward_together

    def recorded(model: Any, parts: Any, wanted: Any = None) -> Any:
        together.append([tuple(tokens.shape) for tokens, _ in parts])
        return forward_together(model, parts, wanted)

    monkeypatch.setattr(generator, "forward_together", recorded)
    engine = build_engine(Settings(no_cache=True, decode_gap=1e-9), str(tiny_model_dir))
    tokenizer = engine.tokenizer
    no_end = {t: -100.0 for t in tokenizer.eos_token_ids}
    long_prompt = (tokenizer.encode("Tell me a long story about the sea. ") * 40)[:400]
    prompts = [tokenizer.encode(f"Stream {i}: a story.") for i in range(2)] + [long_prompt]
    params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias=no_end)
    endless = SamplingParams(max_tokens=3000, temperature=0.0, logit_bias=no_end)
    sinks: list[list[Any]] = [[] for _ in prompts]
    engine.start()
    try:
        streams = []
        for tokens, sink in zip(prompts[:2], sinks[:2], strict=True):
            streams.append(engine.submit(tokens, endless, sink.append))
            wait_until(lambda sink=sink: sum(isinstance(e, Delta) for e in sink) > 2)
        engine.submit(long_prompt, params, sinks[2].append)
        wait_until(lambda: ended(sinks[2]))
        for stream in streams:
            stream.cancel()
        wait_until(lambda: all(ended(s) for s in sinks))
    finally:
        engine.stop()
    alone: list[list[Any]] = [[] for _ in prompts]
    solo = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    solo.start()
    try:
        for tokens, sink in zip(prompts, alone, strict=True):  # one after another
            solo.submit(tokens, params, sink.append)
            wait_until(lambda sink=sink: ended(sink))
    finally:
        solo.stop()
    # The long prompt's chunks (all but the last, finished on its own) went through the
    # two streams' decode passes, each chunk the smallest a step takes.
    chunks = [parts[1] for parts in together if parts[0] == (2, 1)]
    assert len(chunks) == len(together) >= (400 - 1) // engine.min_prefill_chunk - 1
    assert all(b == 1 and 0 < n <= engine.min_prefill_chunk for b, n in chunks)
    # Each output is what it is alone: the streams' first 40 tokens, the long prompt's reply.
    assert text(sinks[2]) == text(alone[2]) and isinstance(sinks[2][-1], Finished)
    for beside, by_itself in zip(sinks[:2], alone[:2], strict=True):
        assert sum(isinstance(e, Delta) for e in beside) > 40
        assert text(beside).startswith(text(by_itself)) and len(text(by_itself)) > 0


def test_a_prompt_prefilled_beside_streams_is_cached_chunk_by_chunk(tiny_model_dir, monkeypatch):

    stored: list[int] = []  # tokens of each state the long prompt's request put in the cache
    import mlx_cache_server.engine.exits as exits  # where the batch stores a sequence's KV

    store = exits.store

    def storing(engine: Any, request: Any, state: Any) -> None:
        if request.tokens == long_prompt:
            stored.append(len(state[1]))
        store(engine, request, state)

    monkeypatch.setattr(exits, "store", storing)
    engine = build_engine(Settings(decode_gap=1e-9), str(tiny_model_dir))
    tokenizer = engine.tokenizer
    no_end = {t: -100.0 for t in tokenizer.eos_token_ids}
    long_prompt = (tokenizer.encode("Tell me a long story about the sea. ") * 40)[:400]
    stream: list[Any] = []
    long: list[Any] = []
    again: list[Any] = []
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=no_end)
    engine.start()
    try:
        limit = SamplingParams(max_tokens=3000, logit_bias=no_end)
        running = engine.submit(tokenizer.encode("Stream: a story."), limit, stream.append)
        wait_until(lambda: sum(isinstance(e, Delta) for e in stream) > 2)
        engine.submit(long_prompt, greedy, long.append)
        wait_until(lambda: ended(long))
        running.cancel()
        engine.submit(long_prompt, greedy, again.append)
        wait_until(lambda: ended(again))
    finally:
        engine.stop()
    # A growing prefix each chunk step, then the whole prompt at its first token (whose
    # copy is only what the chunks left), then the prompt and its reply as it ended.
    prompt_end = stored.index(len(long_prompt))
    chunks = stored[:prompt_end]
    assert len(chunks) >= (400 - 1) // engine.min_prefill_chunk - 2
    assert chunks == sorted(set(chunks)) and chunks[-1] < len(long_prompt)
    assert next(e for e in again if isinstance(e, Started)).cached_tokens == len(long_prompt) - 1
    assert text(again) == text(long)
