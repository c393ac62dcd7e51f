"""mlx-lm's `BatchGenerator` with a step of our own, its model calls overridable.

mlx-lm's step (`BatchGenerator._next`, mlx-lm 0.32) decodes the streams, admits waiting
prompts to the prompt batch, moves the prompts down to their last token into the
streams, then prefills a chunk of every other prompt. `StepGenerator.step` is that step,
written here, with its model calls made methods a subclass overrides: `decode` (the
streams' step, by default their own `next`), `prefill` (a chunk of each prompt, by
default the prompt batch's own `prompt`, its rotated windows put in order first:
`windows`) and `join` (prompts made streams, which runs their first step: mlx-lm's
streams decode a step ahead). The state a subclass plans a step from is read through
public views (`streams`, `prompt_batch`, `waiting`, `prefilling`), never set through them.

Invariants: with `decode`, `prefill` and `join` not overridden, a step gives the responses
mlx-lm's own step gives, in the same order, and leaves the same state (tokens, caches,
counters); `step` is what `next` and `next_generated` run.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from .windows import in_order


class StepGenerator(BatchGenerator):
    """`BatchGenerator` whose step is `step`; `first_uid`: the uid its first sequence
    gets (mlx-lm numbers them on from there)."""

    def __init__(self, model: Any, first_uid: int = 0, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._uid_count = first_uid

    # ------------------------------------------------------------------ what a step reads

    @property
    def streams(self) -> GenerationBatch:
        """The sequences past their prompts, decoded a token a step."""
        return self._generation_batch

    @property
    def prompt_batch(self) -> PromptProcessingBatch:
        """The prompts being prefilled, in the order of `prefilling`."""
        return self._prompt_batch

    @property
    def waiting(self) -> int:
        """How many inserted sequences wait to join the prompt batch."""
        return len(self._unprocessed_sequences)

    @property
    def prefilling(self) -> list[list[list[int]]]:
        """For each prompt being prefilled, its segments not prefilled yet (the next
        step's chunk is cut from the first): lists of the generator's own, to read only."""
        return [list(sequence[0]) for sequence in self._currently_processing]

    # ------------------------------------------------------------ the calls a step makes

    def decode(self, streams: GenerationBatch) -> list[GenerationBatch.Response]:
        """One step of the streams (there are some): a response for each token emitted."""
        return streams.next()

    def prefill(self, batch: PromptProcessingBatch, prompts: list[list[int]]) -> None:
        """Prefill each prompt of `batch` with its chunk of `prompts` (maybe none)."""
        if any(len(p) > 1 for p in prompts):
            in_order(batch.prompt_cache)  # mlx-lm 0.32's mask after a rotation: `windows`
        batch.prompt(prompts)

    def join(self, batch: PromptProcessingBatch, last: list[list[int]]) -> GenerationBatch:
        """The prompts of `batch` made streams, each given its `last` token: mlx-lm runs
        that token's pass as it makes them (its streams decode a step ahead)."""
        return batch.generate(last)

    # ------------------------------------------------------------------------- the step

    def _next(self) -> tuple[list[Any], list[Any]]:
        return self.step()

    def step(self) -> tuple[list[Any], list[Any]]:
        """mlx-lm's step, its model calls `decode` and `prefill`: (prompt responses,
        generation responses)."""
        generated: list[Any] = []
        prompted: list[Any] = []
        if len(self._generation_batch) > 0:
            tic = time.perf_counter()
            generated = self.decode(self._generation_batch)
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generated)
            self._counters.generation_steps += 1
            if self._counters.generation_steps % 512 == 0:
                mx.clear_cache()
        if len(self._generation_batch) >= self.completion_batch_size:
            return prompted, generated  # the streams fill the batch: nothing prefilled
        self._admit()
        prompted += self._start_decoding()
        prompts = self._cut_chunks(prompted)
        self._counters.prompt_tokens += sum(len(p) for p in prompts)
        tic = time.perf_counter()
        self.prefill(self._prompt_batch, prompts)
        self._counters.prompt_time += time.perf_counter() - tic
        return prompted, generated

    def _admit(self) -> None:
        """Move as many waiting sequences to the prompt batch as both batches have room for."""
        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(self._generation_batch),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))

    def _start_decoding(self) -> list[PromptProcessingBatch.Response]:
        """Move the prompts left with their last token only to the streams."""
        ending = [i for i, (segments, _, _) in enumerate(self._currently_processing)
                  if len(segments) == 1 and len(segments[0]) == 1]  # fmt: skip
        if not ending:
            return []
        last = [self._currently_processing[i][0][0] for i in ending]
        progress = [(self._currently_processing[i][2],) * 2 for i in ending]
        self._currently_processing = [
            s for i, s in enumerate(self._currently_processing) if i not in ending
        ]
        joining = self.join(self._prompt_batch.split(ending), last)
        out = [PromptProcessingBatch.Response(uid, p, True, True)
               for uid, p in zip(joining.uids, progress, strict=True)]  # fmt: skip
        self._generation_batch.extend(joining)
        return out

    def _cut_chunks(self, prompted: list[Any]) -> list[list[int]]:
        """Each prefilling prompt's next chunk (at most `prefill_step_size` tokens of its
        first segment), cut off its segments; a response for each added to `prompted`."""
        chunks = []
        for uid, sequence in zip(self._prompt_batch.uids, self._currently_processing, strict=True):
            response = PromptProcessingBatch.Response(uid, 0, False, False)
            segments = sequence[0]
            n = min(len(segments[0]), self.prefill_step_size)
            chunks.append(segments[0][:n])
            segments[0] = segments[0][n:]
            if not segments[0]:
                segments.pop(0)
                response.end_of_segment = True
            sequence[1] += len(chunks[-1])
            response.progress = (sequence[1], sequence[2])
            prompted.append(response)
        return chunks
