"""What the engine hands the batch it runs: its settings, and where its output goes.

The batch (`batch.Batch`) and the quantized-KV runner (`quantized_kv.QuantizedKVRunner`)
are made by the engine thread from the engine's settings of that moment, and take
nothing else from the engine: these records and the thread's two callbacks (`Fail`,
`Requeue`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_cache_server.prompt_cache import PromptCache

from .events import EngineStats
from .replies import RecentReplies
from .request import Request

# End these requests (and those waiting on them) with an error event saying the message.
Fail = Callable[[list[Request], str], None]
# Put a request back, to be admitted again at the next step.
Requeue = Callable[[Request], None]


@dataclass(frozen=True)
class BatchSettings:
    """How a batch sizes its work: read from the engine when the batch is made."""

    generator: dict[str, Any]  # mlx-lm's BatchGenerator's settings
    completion_batch_size: int
    prefill_step_size: int  # the largest prefill chunk
    min_prefill_chunk: int
    decode_gap: float  # seconds a step that also prefills aims at while streams decode
    max_prefill_wait: float  # seconds a prompt may wait while shorter ones go first
    min_shared_prefix: int


@dataclass(frozen=True)
class Outlet:
    """Where a sequence's output goes: its tokens to its client as text (`tokenizer`), its KV
    into the prompt cache, its reply among those drafts are made from; each counted."""

    tokenizer: Any
    cache: PromptCache | None
    replies: RecentReplies
    stats: EngineStats
