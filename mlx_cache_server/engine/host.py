"""What the batch and the solo runner need of the engine that owns them.

`Engine` satisfies it; `Batch` and `Solo` are typed against it, so they depend on
this narrow view rather than on the class that builds and drives them.
"""

from __future__ import annotations

from typing import Any, Protocol

from mlx_cache_server.prompt_cache import PromptCache

from .events import EngineStats
from .replies import RecentReplies
from .request import Request


class Host(Protocol):
    model: Any
    tokenizer: Any
    cache: PromptCache | None
    replies: RecentReplies
    stats: EngineStats
    batch_args: dict[str, Any]  # mlx-lm's BatchGenerator's settings
    completion_batch_size: int
    prefill_step_size: int
    min_prefill_chunk: int
    max_prefill_wait: float
    decode_gap: float
    min_shared_prefix: int

    def fail(self, requests: list[Request], message: str, reason: str = "error") -> None:
        """End `requests` with an error event saying `message`."""

    def requeue(self, request: Request) -> None:
        """Put a request back in the queue, to be admitted again."""
