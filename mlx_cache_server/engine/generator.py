"""mlx-lm's `BatchGenerator`, with a prompt's chunk riding in the streams' decode pass.

A step of mlx-lm's generator decodes the running streams, then prefills a chunk of each
prompt being prefilled: two forward passes, each reading every weight. When one prompt
is being prefilled beside the streams (a long prompt arriving at a busy server), this
generator runs its chunk and the streams' step in one pass (`forward_together`): the
streams' rows cost a few more rows of the chunk's matrices instead of a pass of their
own, so the steps the streams wait for between two tokens are shorter and the prompt
reaches its first token sooner.

It is the same step otherwise: the adapter's step (`StepGenerator.step`, mlx-lm's own,
written there) decides it, the chunk is the one that step would prefill (`_chunk_beside`
reads it from the same state, before the step), and only the step's two model calls
differ: the streams' `decode` runs the pass over both (`decode_through`), and the
prompt's `prefill` does the bookkeeping mlx-lm's `PromptProcessingBatch.prompt` does
around its model call. Any other step (several prompts, a prompt joining the streams,
nothing decoding, a model `forward_together` does not cover) is mlx-lm's own, or, with
drafts to verify (`speculation`), the streams' verification step (`speculative`).

Invariants: in a step run together, the prompt's cache takes the chunk `_chunk_beside`
read and the streams' caches their one token each, as the two passes would give them
(to the last bits: `forward_together`); what a step planned (its chunk, its drafts) is
forgotten after the step, raised or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from ..mlx_adapter.stepping import StepGenerator
from ..mlx_adapter.streams import decode_through, emitted_counts, next_tokens
from ..runtime import kernel_block
from ..runtime.forward_together import forward_together, logits, supports
from .draft_model import DraftBatch, DraftModel
from .drafting import MAX_DRAFT, Pace, PromptLookup
from .positions import PLAIN, Positions
from .speculative import (
    MAX_ROWS,
    PADDED_ROWS,
    can_verify,
    draft_length,
    longest_draft,
    verify,
)


class MixedGenerator(StepGenerator):
    """`BatchGenerator`, its step that decodes streams and prefills one prompt one pass,
    and (`speculation`) streams' step that verifies their drafts: prompt lookup's,
    or where that finds none, the draft model's (`draft`)."""

    def __init__(
        self,
        model: Any,
        speculation: bool = False,
        draft: DraftModel | None = None,
        positions: Positions = PLAIN,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        # Where each pass's tokens stand (`engine.positions`), and each stream's shift.
        self.positions, self._shifts = positions, {}
        # Off: every step is mlx-lm's own. `forward_together` covers text models only, whose
        # positions are plain.
        self.together = supports(model) and positions is PLAIN
        self.speculation, self.draft_model = speculation, draft
        self._skips = kernel_block.skips_fillers(model)  # a pass's fillers cost nothing
        # Each stream's lookup index, its pace, and its pace for the draft model's drafts.
        self._drafting: dict[int, tuple[PromptLookup, Pace, Pace]] = {}
        self._model_batch: DraftBatch | None = None  # the draft model's KV, once it drafted
        self._model_uids: set[int] = set()  # the streams it keeps rows for
        self._modelled: list[bool] = []  # the step's streams whose draft is the model's
        self._chunk: list[int] | None = None  # the step's prompt chunk run beside the streams
        self._step_drafts: list[list[int]] = []  # the step's drafts to verify ([]: none)
        self.on_verified: Callable[[int, int, int], None] | None = None  # (uid, drafted, ok)
        # A new stream's other texts to draft from: its tenant's recent replies (`replies`).
        self.recent_for: Callable[[int], list[PromptLookup]] = lambda uid: []

    def step(self) -> tuple[list[Any], list[Any]]:
        chunk = self._chunk_beside() if self.together else None
        drafts: list[list[int]] = []
        if chunk is None:
            self._modelled = []
            drafts = self._drafts() if self.speculation else []
        self._chunk, self._step_drafts = chunk, drafts
        try:
            return super().step()
        finally:
            self._chunk, self._step_drafts = None, []

    def decode(self, streams: GenerationBatch) -> list[GenerationBatch.Response]:
        with self.positions.decoding(self._stream_shifts(streams)):
            return self._decode(streams)

    def _stream_shifts(self, streams: GenerationBatch) -> list[int]:
        """Each stream's shift (`engine.positions`): its sequence's, worked out once."""
        shifts, known = [], self._shifts
        self._shifts = {}
        for uid, tokens in zip(streams.uids, streams.tokens, strict=True):
            shift = known.get(uid)
            self._shifts[uid] = shift if shift is not None else self.positions.shift(tokens)
            shifts.append(self._shifts[uid])
        return shifts

    def _decode(self, streams: GenerationBatch) -> list[GenerationBatch.Response]:
        if self._chunk is not None:
            together = _Together(self.model, self._chunk, self.prompt_batch.prompt_cache)
            return decode_through(streams, together)
        if self._step_drafts:
            return self._verified(streams, self._step_drafts)
        return super().decode(streams)

    def prefill(self, batch: PromptProcessingBatch, prompts: list[list[int]]) -> None:
        if self._chunk is None:
            with self.positions.prefilling(list(zip(batch.tokens, prompts, strict=True))):
                return super().prefill(batch, prompts)
        _prefilled(batch, self._chunk, prompts)  # the streams' pass ran it

    def join(self, batch: PromptProcessingBatch, last: list[list[int]]) -> GenerationBatch:
        rows = list(zip(batch.tokens, last, strict=True))
        with self.positions.prefilling(rows):
            return super().join(batch, last)

    def _drafts(self) -> list[list[int]]:
        """A draft for each stream for the next step: its prompt-lookup guess, as long as its
        `Pace` says and its `max_tokens` leaves room for, or where lookup finds none the draft
        model's, as long as the stream's pace for those says; all cut to `draft_length`; []
        for a plain step, when no stream has one or too few do (a stream without one rides
        along: `speculative`)."""
        streams = self.streams
        if not can_verify(streams, MAX_ROWS if self._skips else PADDED_ROWS):
            return []
        uids = streams.uids
        self._drafting = {u: d for u, d in self._drafting.items() if u in uids}
        longest = longest_draft(len(uids))
        for uid in uids:
            if uid not in self._drafting:
                self._drafting[uid] = (PromptLookup(self.recent_for(uid)), Pace(), Pace())
        # Every stream's paces count its step, drafted or not; a plain step is known before
        # the wait for the last step's tokens, which a plain step does not need.
        emitted = emitted_counts(streams)
        rooms = [m - n - 1 for m, n in zip(streams.max_tokens, emitted, strict=True)]
        lengths, modelled = [], []
        for uid, room, tokens in zip(uids, rooms, streams.tokens, strict=True):
            lookup, pace, by_model = self._drafting[uid]
            lookup.extend(tokens[len(lookup.tokens) :])  # the tokens known without the wait
            run = lookup.run(MAX_DRAFT) if not pace.paused and pace.k < MAX_DRAFT else 0
            lengths.append(min(pace.next_length(run), room, longest))
            most = 0
            if self.draft_model is not None:
                most = min(by_model.next_length(), self.draft_model.tokens, room, longest)
            modelled.append(max(most, 0))
        if max(lengths) <= 0 and max(modelled) <= 0:
            return []
        drafts = []
        for i, (uid, last) in enumerate(zip(uids, next_tokens(streams).tolist(), strict=True)):
            lookup = self._drafting[uid][0]
            lookup.extend([last])
            drafts.append(lookup.draft(lengths[i]) if lengths[i] > 0 else [])
        self._modelled = [bool(n) and not d for n, d in zip(modelled, drafts, strict=True)]
        if self.draft_model is not None:
            drafts = self._model_drafts(uids, drafts, modelled)
        paces = [
            self._drafting[u][2 if m else 1] for u, m in zip(uids, self._modelled, strict=True)
        ]
        rates = [pace.rate for pace in paces]
        k = draft_length([len(d) for d in drafts], rates, padded=not self._skips)
        return [d[:k] for d in drafts] if k else []

    def _model_drafts(
        self, uids: list[int], drafts: list[list[int]], lengths: list[int]
    ) -> list[list[int]]:
        """`drafts`, the draft model's drafts (as long as `lengths`) in place of the
        streams' that lookup left empty. The draft model keeps rows for the streams that
        have asked it for a draft (one that lookup always drafts for never costs it a
        prefill), fed whether it drafts this step or not (`DraftBatch`)."""
        asked = {u for u, m in zip(uids, self._modelled, strict=True) if m}
        self._model_uids = {u for u in self._model_uids if u in uids} | asked
        if not self._model_uids:
            self._model_batch = None  # its streams are gone, and their KV with them
            return drafts
        if self._model_batch is None:
            self._model_batch = self.draft_model.start()
        members = [u for u in uids if u in self._model_uids]
        k = max((n for n, m in zip(lengths, self._modelled, strict=True) if m), default=0)
        sequences = [self._drafting[u][0].tokens for u in members]
        made = dict(zip(members, self._model_batch.draft(members, sequences, k), strict=True))
        rows = zip(uids, drafts, lengths, self._modelled, strict=True)
        return [made[u][:n] if own else d for u, d, n, own in rows]

    def _verified(self, streams: Any, drafts: list[list[int]]) -> list[Any]:
        uids = list(streams.uids)  # before the step: it drops the streams that end
        responses, agreed, used = verify(streams, drafts)
        modelled = self._modelled or [False] * len(uids)  # [] for drafts not `_drafts`'
        rows = zip(uids, drafts, agreed, used, modelled, strict=True)
        for uid, draft, ok, emitted, by_model in rows:
            if not draft:
                continue
            if uid in self._drafting:
                self._drafting[uid][2 if by_model else 1].saw(len(draft), ok)
            if self.on_verified is not None:
                self.on_verified(uid, len(draft), emitted)
        return responses

    def _chunk_beside(self) -> list[int] | None:
        """The tokens the next step prefills if it decodes the streams and prefills one
        prompt, which takes no other part in it (not joining the streams: more than its
        last token left); None for any other step. Read as `StepGenerator.step` reads
        them: it admits no prompt while one is being prefilled and none waits."""
        streams = len(self.streams)
        if not 0 < streams < self.completion_batch_size or self.waiting:
            return None
        prefilling = self.prefilling
        if len(prefilling) != 1 or len(self.prompt_batch) != 1:
            return None
        segments = prefilling[0]
        if len(segments) == 1 and len(segments[0]) == 1:
            return None  # its last token: the step moves it to the streams
        if self.prefill_step_size > self.prompt_batch.prefill_step_size:
            # The prompt batch would cut the chunk into several passes (the engine never
            # asks for more than its largest chunk, which the prompt batch was made with).
            return None
        return segments[0][: self.prefill_step_size]


class _Together:
    """The streams' forward pass for one step: over their tokens and the prompt's chunk."""

    def __init__(self, model: Any, chunk: list[int], cache: list[Any]) -> None:
        self.model, self.chunk, self.cache = model, mx.array([chunk]), cache

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        # The chunk's logits are never read (mlx-lm's prompt pass evaluates its cache only).
        parts = [(inputs, cache), (self.chunk, self.cache)]
        hidden, _ = forward_together(self.model, parts, wanted=[True, False])
        return logits(self.model, hidden)


def _prefilled(batch: PromptProcessingBatch, chunk: list[int], prompts: list[list[int]]) -> None:
    """`PromptProcessingBatch.prompt` for a chunk the streams' pass ran: its tokens
    recorded, its KV waited for (the streams' step set the pass going)."""
    if prompts != [chunk]:  # the step and `_chunk_beside` disagree: a bug, said loudly
        raise RuntimeError("the prefilled chunk is not the one the step ran")
    batch.tokens[0] += chunk
    mx.eval([c.state for c in batch.prompt_cache])
    mx.clear_cache()
