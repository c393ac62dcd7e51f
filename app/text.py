"""Text-side helpers for generation: stop strings across token boundaries."""

from __future__ import annotations


class StopMatcher:
    """Emits generated text, holding back what could still become a stop string.

    A stop string may span several tokens; text that could be its start is held
    until it is ruled out, so a stop string is never emitted, even in part.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit after `text` was generated; sets `stopped` on a match."""
        if not self.stops:
            return text
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._pending, self.stopped = self._pending[: min(hits)], "", True
            return out
        hold = max((_overlap(self._pending, s) for s in self.stops), default=0)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """What was held back, once generation has ended without a stop."""
        out, self._pending = self._pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
