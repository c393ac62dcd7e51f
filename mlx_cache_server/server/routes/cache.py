"""GET and DELETE /v1/cache: the prompt cache, per model (admin); its largest branches
and recent requests for the cache page, once or as a stream of server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from ...serving.cache_view import MAX_NODES, activity, cache_view, split_key
from ...serving.sse import KEEP_ALIVE, EventStream
from ..auth import Admin
from ..state import ServerState, State, pool_errors

router = APIRouter(tags=["cache"], dependencies=[Admin])


class Hits(BaseModel):
    exact: int
    shorter: int
    longer: int


class ModelCacheStats(BaseModel):
    model: str
    namespace: str | None
    sequences: int
    bytes: int
    lookups: int
    hits: Hits
    misses: int
    tokens_asked: int
    tokens_reused: int
    reuse: float
    inserts: int
    rejected: int
    evictions: int
    shortened: int  # sequences cut back at their end to make room, instead of evicted
    disk_hits: int  # lookups that loaded part of their prompt's KV from the disk tier
    tokens_from_disk: int


class DiskReport(BaseModel):
    """The disk tier: its files, and what was read and written (bytes, seconds)."""

    folder: str
    max_bytes: int
    bytes: int
    files: int
    tokens_loaded: int
    bytes_loaded: int
    load_seconds: float
    writes: int
    bytes_written: int
    write_seconds: float
    pending: int
    dropped: int  # files found missing, truncated or corrupt, and removed
    evicted: int
    skipped: int  # writes not made: no room, a gap in the path, or an I/O error


class CacheReport(BaseModel):
    model: str  # each model has a cache of its own: `?model=` picks which (default: the default)
    loaded: bool = True  # an unloaded model's cache went with it (to the disk tier, if any)
    enabled: bool
    max_sequences: int | None = None
    max_bytes: int | None = None
    kv_bits: int | None = None  # the KV's quantization (`--kv-bits`); None: full precision
    # How the model's layers are stored: "prefix" (attention: any prefix reusable),
    # "checkpointed" (a hybrid: attention and window KV by token, recurrent state reusable
    # where a checkpoint was stored) or "snapshot".
    mode: str | None = None
    sequences: int = 0
    bytes: int = 0
    models: list[ModelCacheStats] = []
    disk: DiskReport | None = None


class Cleared(BaseModel):
    cleared: int  # model keys (a model in each tenant's namespace) flushed
    # Models not loaded, whose disk tier still holds what they cached: flush them loaded.
    not_flushed: list[str] = []


def _named(state: ServerState, model: str | None) -> tuple[Any, Any]:
    """The model `?model=` names (the default without it) and its loaded form, or None; an
    unknown name is the API's 404."""
    with pool_errors(state.models):
        spec = state.models.spec(model) if model is not None else state.models.default
        return spec, state.models.get(spec.id)


@router.get("/v1/cache", response_model=CacheReport, summary="Prompt cache statistics")
async def cache_stats(state: State, model: str | None = None) -> CacheReport:
    spec, served = _named(state, model)
    if state.models.loader.kind(spec) == "embedding":  # no prompts to cache: no cache
        return CacheReport(model=spec.id, loaded=served is not None, enabled=False)
    if served is None:
        return CacheReport(model=spec.id, loaded=False, enabled=not state.settings.no_cache)
    cache = served.engine.cache if served.engine is not None else None
    if cache is None:  # --no-cache, or an embedding model
        return CacheReport(model=spec.id, enabled=False)
    models = []
    for key, s in cache.stats_by_model().items():
        model, namespace = split_key(key)
        models.append(
            ModelCacheStats(
                model=model,
                namespace=namespace,
                sequences=s.sequences,
                bytes=s.bytes,
                lookups=s.lookups,
                hits=Hits(exact=s.exact, shorter=s.shorter, longer=s.longer),
                misses=s.misses,
                tokens_asked=s.tokens_asked,
                tokens_reused=s.tokens_reused,
                reuse=s.reuse,
                inserts=s.inserts,
                rejected=s.rejected,
                evictions=s.evictions,
                shortened=s.shortened,
                disk_hits=s.disk_hits,
                tokens_from_disk=s.tokens_from_disk,
            )
        )
    disk = None
    if cache.disk is not None:
        d = cache.disk
        disk = DiskReport(folder=str(d.folder), max_bytes=d.max_bytes, **asdict(d.stats))
    return CacheReport(
        model=spec.id,
        enabled=True,
        max_sequences=cache.max_sequences,
        max_bytes=cache.byte_budget,
        kv_bits=served.engine.kv_bits,
        mode=served.engine.cache_mode,
        sequences=len(cache),
        bytes=cache.nbytes,
        models=models,
        disk=disk,
    )


@router.delete("/v1/cache", response_model=Cleared, summary="Flush the prompt cache")
async def cache_flush(state: State, model: str | None = None) -> Cleared:
    """Flush one model's cache (`?model=`), or every loaded model's. An unloaded model's RAM
    cache went with it; its disk tier is not reached (`not_flushed`): load it, then flush."""
    with pool_errors(state.models):
        specs = [state.models.spec(model)] if model is not None else state.models.specs
    loaded = {s.id: state.models.get(s.id) for s in specs}
    engines = [m.engine for m in loaded.values() if m is not None and m.engine is not None]
    not_flushed = []
    if state.settings.cache_dir and not state.settings.no_cache:
        not_flushed = [  # a kind not known yet (not downloaded) may still have a disk tier
            s.id
            for s in specs
            if loaded[s.id] is None and state.models.loader.kind(s) != "embedding"
        ]
    cleared = 0
    for engine in engines:
        if engine.cache is None:
            continue
        cleared += engine.flush_cache()  # every tenant's namespace of the model
        engine.release_memory()  # what the flush freed goes back now, not at the next pause
    return Cleared(cleared=cleared, not_flushed=not_flushed)


EVERY = 1.0  # seconds between two looks at the cache for the event stream: the page's pace
QUIET = 15.0  # seconds without a change before a keep-alive comment
MAX_VIEWS = 8  # views kept for sharing, each a model and a size


def _view(state: ServerState, model: str | None, max_nodes: int) -> dict[str, Any]:
    spec, served = _named(state, model)
    engine = served.engine if served is not None else None
    if engine is None:  # not loaded, or an embedding model: nothing cached to show
        view: dict[str, Any] = {"model": spec.id, "enabled": False, "loaded": served is not None}
    else:
        view = {**cache_view(engine, spec.id, max_nodes), "loaded": True}
    # The models it could show: the page's picker (the admin key may not list /v1/models).
    models = [s.id for s in state.models.specs if state.models.loader.kind(s) != "embedding"]
    return {**view, "models": models, **activity(state.metrics)}


def _shared_view(state: ServerState, model: str | None, max_nodes: int) -> dict[str, Any]:
    """`_view`, made at most once a second for all the feeds that show the same."""
    key, now = (model, max_nodes), time.monotonic()
    made = state.views.get(key)
    if made is None or now - made[0] >= EVERY:
        if len(state.views) >= MAX_VIEWS:  # feeds asking for many kinds of views: the last few
            state.views.clear()
        made = state.views[key] = (now, _view(state, model, max_nodes))
    return made[1]


@router.get("/v1/cache/tree", summary="The prompt cache's largest branches and recent requests")
async def cache_tree(
    state: State, model: str | None = None, max_nodes: int = Query(MAX_NODES, ge=1, le=1000)
) -> dict[str, Any]:
    """Per tenant namespace, the radix tree's top `max_nodes` branches (text, tokens, bytes,
    hits, last use, tier); RAM and disk totals and budgets; the cached share of prompt
    tokens over the last minutes; the latest requests with queued, prefill and decode time."""
    return await asyncio.to_thread(_view, state, model, max_nodes)


@router.get("/v1/cache/events", summary="The cache page's live feed (server-sent events)")
async def cache_events(
    request: Request, state: State, model: str | None = None,
    max_nodes: int = Query(MAX_NODES, ge=1, le=1000),
) -> EventStream:  # fmt: skip
    """`/v1/cache/tree`'s body as an event each time it changes, looked at once a second;
    the stream ends when the server shuts down."""
    first = await asyncio.to_thread(_shared_view, state, model, max_nodes)  # a bad model: 404

    async def events() -> AsyncIterator[str]:
        view, last, quiet = first, None, 0.0
        while not state.draining and not await request.is_disconnected():
            # `now` changes every time: a change is a change of anything else.
            same = {k: v for k, v in view.items() if k != "now"}
            if same != last:
                body = await asyncio.to_thread(json.dumps, view, separators=(",", ":"))
                yield f"data: {body}\n\n"
                last, quiet = same, 0.0
            elif quiet >= QUIET:
                yield KEEP_ALIVE
                quiet = 0.0
            await asyncio.sleep(EVERY)
            quiet += EVERY
            view = await asyncio.to_thread(_shared_view, state, model, max_nodes)

    return EventStream(events())
