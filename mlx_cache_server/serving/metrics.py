"""Prometheus metrics, in a registry of the app's own (no process-global state)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..engine import Engine
    from ..models.pool import ModelPool

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
RECENT = 50  # requests the cache page lists


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlx_requests", "HTTP requests by route and status", ["route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "mlx_time_to_first_token_seconds", "Time to first token", ["route"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "mlx_request_duration_seconds", "End-to-end generation time", ["route"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "mlx_prompt_tokens", "Prompt tokens received", registry=self.registry
        )
        self.cached_tokens = Counter(
            "mlx_cached_tokens", "Prompt tokens whose KV came from the cache",
            registry=self.registry,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "mlx_completion_tokens", "Tokens generated", registry=self.registry
        )
        # The request log's records of the latest requests, with when each ended (the page's
        # list of recent requests and its hit rate over the last minutes).
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    def watch(self, pool: ModelPool) -> None:
        """Read the pool's models, their engines and caches at every scrape."""
        self.registry.register(_ModelsCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ModelsCollector:
    """Read at scrape time: each configured model's state, and each loaded one's queue,
    running requests and cache."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        engines = [m.served.engine for m in self.pool.loaded() if m.served.engine is not None]
        waiting = sum(e.waiting for e in engines)
        yield _gauge("mlx_queue_depth", "Requests submitted but not yet running", waiting)
        running = sum(e.running for e in engines)
        yield _gauge("mlx_running_requests", "Requests being generated", running)
        yield from _caches(engines)
        yield from _drafts(engines)

    def _models(self) -> Iterator[Metric]:
        labels = ["model"]
        loaded = GaugeMetricFamily("mlx_model_loaded", "1 if the model is loaded", labels=labels)
        nbytes = GaugeMetricFamily(
            "mlx_model_memory_bytes", "Bytes the model counts against the memory budget",
            labels=labels,
        )  # fmt: skip
        loads = CounterMetricFamily("mlx_model_loads", "Times the model was loaded", labels=labels)
        unloads = CounterMetricFamily("mlx_model_unloads", "Times it was unloaded", labels=labels)
        seconds = GaugeMetricFamily(
            "mlx_model_load_seconds", "How long its last load took", labels=labels
        )
        for s in self.pool.states():
            name = [s.spec.id]
            loaded.add_metric(name, 1 if s.status == "loaded" else 0)
            nbytes.add_metric(name, s.bytes)
            loads.add_metric(name, s.loads)
            unloads.add_metric(name, s.unloads)
            if s.load_seconds is not None:
                seconds.add_metric(name, s.load_seconds)
        yield from (loaded, nbytes, loads, unloads, seconds)
        if self.pool.budget is not None:
            yield _gauge("mlx_memory_budget_bytes", "The models' memory budget", self.pool.budget)


def _drafts(engines: list[Engine]) -> Iterator[Metric]:
    drafted = CounterMetricFamily(
        "mlx_speculation_drafted_tokens", "Draft tokens verified", labels=["model"]
    )
    accepted = CounterMetricFamily(
        "mlx_speculation_accepted_tokens", "Draft tokens accepted", labels=["model"]
    )
    drafts = CounterMetricFamily("mlx_speculation_drafts", "Drafts verified", labels=["model"])
    for engine in engines:
        drafted.add_metric([engine.model_id], engine.stats.drafted)
        accepted.add_metric([engine.model_id], engine.stats.accepted)
        drafts.add_metric([engine.model_id], engine.stats.drafts)
    yield from (drafted, accepted, drafts)


def _caches(engines: list[Engine]) -> Iterator[Metric]:
    labels = ["model", "namespace"]
    seqs = GaugeMetricFamily("mlx_cache_sequences", "Cached sequences", labels=labels)
    nbytes = GaugeMetricFamily("mlx_cache_bytes", "Bytes held by the cache", labels=labels)
    evictions = CounterMetricFamily("mlx_cache_evictions", "Evicted sequences", labels=labels)
    shortened = CounterMetricFamily(
        "mlx_cache_shortened", "Sequences cut back at their end to make room", labels=labels
    )
    reuse = GaugeMetricFamily(
        "mlx_cache_reuse_ratio", "Cached tokens / prompt tokens looked up", labels=labels
    )
    disk_hits = CounterMetricFamily(
        "mlx_cache_disk_hits", "Lookups that loaded KV from the disk tier", labels=labels
    )
    budget = GaugeMetricFamily(
        "mlx_cache_budget_bytes", "The cache's byte budget", labels=["model"]
    )
    disks = []
    for engine in engines:
        cache = engine.cache
        if cache is None:
            continue
        for key, stats in cache.stats_by_model().items():
            names = _labels(key)
            seqs.add_metric(names, stats.sequences)
            nbytes.add_metric(names, stats.bytes)
            evictions.add_metric(names, stats.evictions)
            shortened.add_metric(names, stats.shortened)
            reuse.add_metric(names, stats.reuse)
            disk_hits.add_metric(names, stats.disk_hits)
        if cache.byte_budget is not None:
            budget.add_metric([engine.model_id], cache.byte_budget)
        if cache.disk is not None:
            disks.append((engine.model_id, cache.disk))
    yield from (seqs, nbytes, evictions, shortened, reuse, budget)
    if disks:
        yield disk_hits
        yield from _disk(disks)


def _disk(disks: list[tuple[str, Any]]) -> Iterator[Metric]:
    labels = ["model"]
    gauges = [
        ("mlx_cache_disk_bytes", "Bytes of the disk tier's files", lambda d: d.stats.bytes),
        ("mlx_cache_disk_budget_bytes", "The disk tier's byte budget", lambda d: d.max_bytes),
        ("mlx_cache_disk_files", "Files in the disk tier", lambda d: d.stats.files),
        ("mlx_cache_disk_pending_writes", "Segments queued for writing", lambda d: d.stats.pending),
    ]
    for name, doc, value in gauges:
        gauge = GaugeMetricFamily(name, doc, labels=labels)
        for model, disk in disks:
            gauge.add_metric([model], value(disk))
        yield gauge
    for name, doc, field in (
        ("loaded_tokens", "Tokens loaded from disk", "tokens_loaded"),
        ("loaded_bytes", "Bytes read from disk", "bytes_loaded"),
        ("load_seconds", "Time spent loading from disk", "load_seconds"),
        ("written_bytes", "Bytes written to disk", "bytes_written"),
        ("write_seconds", "Time spent writing to disk", "write_seconds"),
        ("dropped_files", "Files found missing, truncated or corrupt, and removed", "dropped"),
        ("evicted_files", "Files removed to stay within the disk budget", "evicted"),
        ("skipped_writes", "Segments not written: no room, a gap or an I/O error", "skipped"),
    ):
        counter = CounterMetricFamily(f"mlx_cache_disk_{name}", doc, labels=labels)
        for model, disk in disks:
            counter.add_metric([model], getattr(disk.stats, field))
        yield counter


def _labels(key: Any) -> list[str]:
    if isinstance(key, tuple):
        return [str(key[0]), str(key[1])]
    return [str(key), ""]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
