"""The admitted requests of a batch and the two generators they run in.

A sequence prefilled on its own decodes in a second generator, the side batch, when
joining the main one would pad it mostly with nothing (`placement`).

Invariants: `active` maps the generator's uid of every admitted, unended request to
it, the side batch's uids from `SIDE_UIDS` on and the main one's below; prompts are
prefilled in the main batch only. Owned by the engine thread alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .generator import MixedGenerator
from .placement import place
from .request import Request

SIDE_UIDS = 1 << 48  # the side batch numbers its sequences from here: one `active` for both


class Running:
    def __init__(
        self,
        model: Any,
        generator: dict[str, Any],
        completion_batch_size: int,
        on_verified: Callable[[int, int, int], None],
        recent_for: Callable[[int], list[Any]],
    ) -> None:
        """`generator`: mlx-lm's BatchGenerator's settings; `on_verified` and `recent_for`:
        what both generators tell of a verified draft, and ask for drafts from."""
        self.gen = MixedGenerator(model, **generator)
        self.side = MixedGenerator(model, first_uid=SIDE_UIDS, **generator)
        self.gen.on_verified = self.side.on_verified = on_verified
        self.gen.recent_for = self.side.recent_for = recent_for
        self.completion_batch_size = completion_batch_size
        self.active: dict[int, Request] = {}

    def close(self) -> None:
        # Each generator restores the wired limit it found (Metal): the side batch's is
        # the one the main batch set, so the main batch restores the system's last.
        self.side.close()
        self.gen.close()

    def prefilling(self) -> list[Request]:
        """The admitted requests whose prompts are still being prefilled."""
        return [r for r in self.active.values() if r.prefilling]

    def decoding(self) -> bool:
        """Whether any admitted request is past its prompt."""
        return any(not r.prefilling for r in self.active.values())

    def sided(self) -> bool:
        return any(uid >= SIDE_UIDS for uid in self.active)

    def place(self, length: int) -> int:
        """Which batch a sequence of `length` tokens decodes in (`placement.place`)."""
        main: list[int] = []
        side: list[int] = []
        for uid, r in self.active.items():
            if not r.prefilling:
                (side if uid >= SIDE_UIDS else main).append(len(r.tokens) + r.generated)
        return place(length, main, side, self.completion_batch_size)

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """`BatchGenerator.remove` over both batches: each takes out its own."""
        out: dict[int, Any] = {}
        for gen, own in ((self.gen, [u for u in uids if u < SIDE_UIDS]),
                         (self.side, [u for u in uids if u >= SIDE_UIDS])):  # fmt: skip
            if own:
                out.update(gen.remove(own, return_prompt_caches=return_prompt_caches))
        return out
