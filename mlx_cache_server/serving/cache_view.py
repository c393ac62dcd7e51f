"""What the cache page shows (admin): each model's radix tree as its largest branches,
per tenant, with their text; each tier's totals and budget; the share of prompt tokens
the cache served over the last minutes; the latest requests and where their time went.

Plain data for `GET /v1/cache/tree` and the page's event stream. Bounded whatever the
cache holds: `max_nodes` branches a namespace (`mlx_cache_server.prompt_cache.outline`), `RECENT`
requests.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

from mlx_cache_server.prompt_cache.outline import Branch

from ..models.vision import IMAGE_BASE
from .metrics import Metrics

WINDOW = 300.0  # seconds the hit rate is taken over
MAX_NODES = 100


def split_key(key: Hashable) -> tuple[str, str | None]:
    """A cache key's model and tenant namespace (None: the server has no API keys)."""
    return (str(key[0]), str(key[1])) if isinstance(key, tuple) else (str(key), None)


def cache_view(engine: Any, model: str, max_nodes: int = MAX_NODES) -> dict[str, Any]:
    """A loaded model's cache: its tiers and each namespace's largest branches."""
    cache = engine.cache
    view: dict[str, Any] = {"model": model, "enabled": cache is not None}
    if cache is None:
        return view
    view["mode"] = engine.cache_mode
    view["ram"] = {"bytes": cache.nbytes, "max_bytes": cache.byte_budget,
                   "sequences": len(cache), "max_sequences": cache.max_sequences}  # fmt: skip
    view["disk"] = None
    if cache.disk is not None:
        d = cache.disk
        view["disk"] = {"bytes": d.nbytes, "max_bytes": d.max_bytes, "files": d.stats.files}
    namespaces = []
    for key, (top, hidden) in sorted(cache.outline(max_nodes).items(), key=lambda kv: str(kv[0])):
        name, tenant = split_key(key)
        namespaces.append({
            "model": name, "namespace": tenant, "hidden": hidden,
            "branches": [_branch(b, engine.tokenizer) for b in top],
        })  # fmt: skip
    view["namespaces"] = namespaces
    return view


def _branch(b: Branch, tokenizer: Any) -> dict[str, Any]:
    return {
        # Its start and end: where a shared prefix begins and where conversations part.
        "text": shown(b.tokens, tokenizer)
        + ("…" if b.size > len(b.tokens) + len(b.tail) else "")
        + shown(b.tail, tokenizer),
        "tokens": b.size,
        "depth": b.depth,
        "bytes": b.bytes,
        "sequences": b.sequences,
        "hits": b.hits,
        "last_used": round(b.last_used, 3),
        "tier": "ram+disk" if b.on_disk else "ram",
        "hidden": b.hidden,
        "children": [_branch(c, tokenizer) for c in b.children],
    }


def shown(tokens: list[int], tokenizer: Any) -> str:
    """`tokens` as text, each run of an image's ids (`models.vision`) as one marker."""
    out, run = [], []
    for i, t in enumerate(tokens):
        if t >= IMAGE_BASE and (i == 0 or tokens[i - 1] != t - 1):
            out.append(tokenizer.decode(run))
            out.append("[image]")
            run = []
        elif t < IMAGE_BASE:
            run.append(t)
    return "".join(out) + tokenizer.decode(run)


def activity(metrics: Metrics, now: float | None = None) -> dict[str, Any]:
    """The latest requests, newest first, and the cache's share of prompt tokens over the
    last `WINDOW` seconds."""
    now = time.time() if now is None else now
    recent = list(metrics.recent)
    window = [r for r in recent if now - r["ended"] <= WINDOW]
    prompt = sum(r["prompt_tokens"] for r in window)
    cached = sum(r["cached_tokens"] for r in window)
    return {
        "now": round(now, 3),  # the server's clock, that `ended` and `last_used` are on
        "hit_rate": {"seconds": WINDOW, "requests": len(window), "prompt_tokens": prompt,
                     "cached_tokens": cached, "share": cached / prompt if prompt else None},
        "requests": [_request(r) for r in reversed(recent)],
    }  # fmt: skip


def _request(r: dict[str, Any]) -> dict[str, Any]:
    queued, ttft, total = r["queued_ms"], r["ttft_ms"], r["total_ms"]
    return {
        "id": r["id"], "route": r["route"], "model": r["model"], "namespace": r["tenant"],
        "ended": round(r["ended"], 3), "finish_reason": r["finish_reason"],
        "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
        "completion_tokens": r["completion_tokens"],
        "cached_share": r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else None,
        "queued_ms": queued,
        "prefill_ms": round(ttft - (queued or 0), 1) if ttft is not None else None,
        "decode_ms": round(total - ttft, 1) if ttft is not None else None,
    }  # fmt: skip
