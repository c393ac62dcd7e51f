"""HTTP routes, one router per resource."""

from . import cache, chat, completions, health, messages, metrics, models, responses

__all__ = ["cache", "chat", "completions", "health", "messages", "metrics", "models", "responses"]
