"""The generation engine: one thread, one batch, one prompt cache (see `engine.Engine`)."""

from .engine import Engine
from .events import (
    Candidate,
    Delta,
    EngineStats,
    Event,
    Failed,
    Finished,
    SamplingParams,
    Started,
    TokenLogprob,
)

__all__ = [
    "Candidate",
    "Delta",
    "Engine",
    "EngineStats",
    "Event",
    "Failed",
    "Finished",
    "SamplingParams",
    "Started",
    "TokenLogprob",
]
