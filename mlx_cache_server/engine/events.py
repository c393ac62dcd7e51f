"""What a request asks of the engine, and the events the engine sends back.

A request's events are `Started` once admitted, `Delta`s as text is produced,
and exactly one of `Finished` or `Failed` to end it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlx_cache_server.engine")


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    # A logits processor the output must follow (a `constraint.GrammarProcessor`), built for
    # this request off the engine's thread: compiling a grammar can take long.
    constraint: Any = None
    # Where a hybrid model's cache is stored while prefilling the prompt: where its
    # messages end (the serving layer finds them), and a token before its end (the
    # engine adds it): a request sharing less than the whole prompt resumes there.
    checkpoints: tuple[int, ...] = ()


@dataclass
class Candidate:
    token: int
    text: str
    bytes: bytes  # the token's own bytes: part of a character for some tokens
    logprob: float


@dataclass
class TokenLogprob(Candidate):
    top: list[Candidate] = field(default_factory=list)


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int
    # When the engine admitted the request (`time.perf_counter`): what it waited before, what
    # its first token took after, in the request log.
    admitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generated: int = 0  # tokens generated so far, this one's included: what a cut stream cost


@dataclass
class Finished:
    reason: str  # "stop", "length" or "cancelled"
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    drafted: int = 0  # draft tokens verified for it (`speculative`), and accepted
    accepted: int = 0


@dataclass
class Failed:
    message: str  # for the client: says what it can act on, never internal detail
    # "error", "shutdown", "timeout" or "grammar"; each surface maps it to its status
    reason: str = "error"


Event = Started | Delta | Finished | Failed


class GrammarFailed(ValueError):
    """A request's grammar could not go on: a limit of the grammar engine met mid-reply.
    The request's own fault: it ends with that said, the batch goes on."""


def log_fault(fault: BaseException) -> None:
    """Log a request's failed sampling: a grammar's failure is the client's (a warning that
    a client can cause, never the server's error log)."""
    if isinstance(fault, GrammarFailed):
        log.warning("a request's grammar failed: %s", fault)
    else:
        log.error("a request's sampling failed: %r", fault)


def sampling_failed(fault: BaseException) -> Failed:
    """The event that ends a request whose sampler or logits processors raised `fault`."""
    if isinstance(fault, GrammarFailed):
        return Failed(f"The request's grammar failed while generating: {fault}", "grammar")
    return Failed("Sampling failed for this request's parameters.")


@dataclass
class EngineStats:
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    drafted: int = 0  # draft tokens verified (`speculative`)
    accepted: int = 0  # of which accepted
    drafts: int = 0  # drafts verified: accepted / drafts is a draft's mean accepted length
