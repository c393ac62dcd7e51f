"""HTTP routes, one router per resource."""

from . import (
    cache,
    chat,
    completions,
    embeddings,
    health,
    messages,
    metrics,
    models,
    responses,
    ui,
)  # fmt: skip

__all__ = [
    "cache", "chat", "completions", "embeddings", "health", "messages", "metrics", "models",
    "responses", "ui",
]  # fmt: skip
