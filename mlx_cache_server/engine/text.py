"""Text-side helpers for generation: stop strings across token boundaries, token bytes."""

from __future__ import annotations

from functools import cache
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer


class StopMatcher:
    """Emits generated text, holding back what could still become a stop string.

    A stop string may span several tokens; text that could be its start is held
    until it is ruled out, so a stop string is never emitted, even in part.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Text safe to emit after `text` was generated; sets `stopped` on a match."""
        if not self.stops:
            return text
        self._pending += text
        hits = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self._pending, self.stopped = self._pending[:at], "", True
            return out
        hold = max((overlap(self._pending, s) for s in self.stops), default=0)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """What was held back, once generation has ended without a stop."""
        out, self._pending = self._pending, ""
        return out


def overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes `token` stands for, also when they are only part of a UTF-8 character.

    Decoding such a token alone gives U+FFFD; clients that join `logprobs` bytes
    across tokens need the token's own bytes instead.
    """
    kind = type(getattr(tokenizer, "_detokenizer", None))
    piece = tokenizer.convert_ids_to_tokens(token)
    if issubclass(kind, BPEStreamingDetokenizer) and isinstance(piece, str):
        table = _gpt2_bytes()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    elif issubclass(kind, SPMStreamingDetokenizer) and isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # a byte-fallback token
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token]).encode()  # special and added tokens: their text


@cache
def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as, to that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table
