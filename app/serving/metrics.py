"""Prometheus metrics, in a registry of the app's own (no process-global state)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prompt_cache.disk import DiskStats

if TYPE_CHECKING:
    from ..engine import Engine

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, engine: Engine) -> None:
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
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Read at scrape time: queue, running requests and the cache, per model key."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield _gauge("mlx_queue_depth", "Requests submitted but not yet running", engine.waiting)
        yield _gauge("mlx_running_requests", "Requests being generated", engine.running)
        cache = engine.cache
        if cache is None:
            return
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
        for key, stats in cache.stats_by_model().items():
            names = _labels(key)
            seqs.add_metric(names, stats.sequences)
            nbytes.add_metric(names, stats.bytes)
            evictions.add_metric(names, stats.evictions)
            shortened.add_metric(names, stats.shortened)
            reuse.add_metric(names, stats.reuse)
            disk_hits.add_metric(names, stats.disk_hits)
        yield from (seqs, nbytes, evictions, shortened, reuse)
        if cache.byte_budget is not None:
            yield _gauge("mlx_cache_budget_bytes", "The cache's byte budget", cache.byte_budget)
        if cache.disk is not None:
            yield disk_hits
            yield from _disk(cache.disk.stats, cache.disk.max_bytes)


def _disk(s: DiskStats, budget: int) -> Iterator[Metric]:
    yield _gauge("mlx_cache_disk_bytes", "Bytes of the disk tier's files", s.bytes)
    yield _gauge("mlx_cache_disk_budget_bytes", "The disk tier's byte budget", budget)
    yield _gauge("mlx_cache_disk_files", "Files in the disk tier", s.files)
    yield _gauge("mlx_cache_disk_pending_writes", "Segments queued for writing", s.pending)
    for name, doc, value in (
        ("loaded_tokens", "Tokens loaded from disk", s.tokens_loaded),
        ("loaded_bytes", "Bytes read from disk", s.bytes_loaded),
        ("load_seconds", "Time spent loading from disk", s.load_seconds),
        ("written_bytes", "Bytes written to disk", s.bytes_written),
        ("write_seconds", "Time spent writing to disk", s.write_seconds),
        ("dropped_files", "Files found missing, truncated or corrupt, and removed", s.dropped),
        ("evicted_files", "Files removed to stay within the disk budget", s.evicted),
        ("skipped_writes", "Segments not written: no room, a gap or an I/O error", s.skipped),
    ):
        counter = CounterMetricFamily(f"mlx_cache_disk_{name}", doc)
        counter.add_metric([], value)
        yield counter


def _labels(key: Any) -> list[str]:
    if isinstance(key, tuple):
        return [str(key[0]), str(key[1])]
    return [str(key), ""]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
