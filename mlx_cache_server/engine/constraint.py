"""Constrained decoding: a grammar (llguidance) as one request's logits processor.

Each constrained request gets its own matcher, run as one of its logits
processors inside the batch's step: the tokens the grammar does not allow next
get -inf. Requests without a grammar pay nothing. Once the grammar is complete
only an end token is allowed, so the request stops there.

The token-level tokenizer llguidance needs costs about a second to build; it is
built once per engine, on first use (`GrammarTokenizer`).

llguidance compiles a grammar by recursion on the native stack, where an overflow
kills the process (llguidance 1.9). Compilation runs `on_deep_stack`, on a thread whose
stack is far larger than what the schema bounds (`serving.schema_bounds`) let a grammar
use. No upstream issue was found; llguidance's maintainers name the recursion, and plan
an iterative rewrite, in https://github.com/guidance-ai/llguidance/pull/321.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .events import GrammarFailed

T = TypeVar("T")
# A thread's stack is reserved address space, committed only as it is used, so a large
# one costs nothing until a deep grammar needs it. tools/schema_bounds.py measures what
# the deepest schema `serving.schema_bounds` admits takes: a small fraction of this.
DEEP_STACK = 64 * 1024**2
_stack_size = threading.Lock()  # threading.stack_size is process-wide: set, start, reset


def on_deep_stack(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread of its own with a `DEEP_STACK` stack; blocks until done
    and returns or raises what `fn` did. For native code that recurses as deep as its
    input (a grammar compiler): a thread pool's threads have the default stack."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller, raised there
            outcome.append((False, e))

    with _stack_size:
        previous = threading.stack_size(DEEP_STACK)
        try:
            thread = threading.Thread(target=run, name="deep-stack", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class GrammarTokenizer:
    """The engine's tokenizer as llguidance sees it, built once, on first use, thread-safely."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._built: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        """The tokenizer; ValueError (every time) if llguidance cannot use this one."""
        with self._lock:
            if isinstance(self._built, ValueError):
                raise self._built
            if self._built is None:
                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                try:
                    self._built = llguidance.hf.from_tokenizer(
                        hf,
                        n_vocab=self._vocab_size,
                        eos_token=sorted(self._tokenizer.eos_token_ids),
                    )
                except Exception as e:  # a slow (Python) tokenizer, say
                    self._built = ValueError(f"this model's tokenizer cannot be constrained: {e}")
                    raise self._built from e
            return self._built


class GrammarProcessor:
    """One request's grammar as a logits processor: `(tokens so far, logits) -> logits`.

    The first call sees the prompt; each later call sees one more token, the one
    sampled last, which the matcher consumes before computing the next mask.
    Reading that token back forces it to be computed before the step is built,
    so while a constrained request runs the batch loses mlx-lm's overlap of one
    step's sampling with the next step's graph (bench/structured.py measures the
    cost alone; a busy batch pays more).
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.grammar = grammar  # what a sharded server's other ranks build theirs from
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(_said(self.matcher.get_error()))
        self.bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
        # The first mask, here: a grammar past the parser's limits (an anyOf of hundreds
        # of wide objects, say) fails on it, a 400 then instead of a failed generation.
        # The first step uses it as it is.
        fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        if self.matcher.is_error():
            raise ValueError(_said(self.matcher.get_error()))
        self.seen: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.shape[-1]
        if self.seen is not None:  # the first step's mask was filled when it was built
            for token in tokens[self.seen : n].tolist():
                if not self.matcher.consume_token(token):
                    # The mask let through what the grammar refuses: the server's fault.
                    raise RuntimeError(
                        f"the grammar refused token {token}: {_said(self.matcher.get_error())}"
                    )
            fill_next_token_bitmask(self.matcher, self.bitmask, 0)
            if self.matcher.is_error():  # a limit hit, say: fail the request, no silent EOS
                raise GrammarFailed(_said(self.matcher.get_error()))
        self.seen = n
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little").astype(np.bool_)
        width = logits.shape[-1]
        allowed = np.zeros(width, np.bool_)  # ids past the tokenizer's (padding) stay out
        allowed[: min(width, bits.size)] = bits[:width]
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))


def _said(error: str) -> str:
    """An llguidance error's first line: the rest quotes the parser state and the whole
    grammar, which can be megabytes in a log line or an error body."""
    return error.strip().splitlines()[0][:300] if error.strip() else "unknown error"


def build_constraint(grammars: GrammarTokenizer, grammar: str) -> GrammarProcessor:
    """A request's processor for `grammar`; run it off the event loop and the engine thread."""
    return on_deep_stack(GrammarProcessor, grammars.get(), grammar)
