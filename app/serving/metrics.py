"""Prometheus metrics, in a registry of the app's own (no process-global state)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
        for key, stats in cache.stats_by_model().items():
            names = _labels(key)
            seqs.add_metric(names, stats.sequences)
            nbytes.add_metric(names, stats.bytes)
            evictions.add_metric(names, stats.evictions)
            shortened.add_metric(names, stats.shortened)
            reuse.add_metric(names, stats.reuse)
        yield from (seqs, nbytes, evictions, shortened, reuse)
        if cache.byte_budget is not None:
            yield _gauge("mlx_cache_budget_bytes", "The cache's byte budget", cache.byte_budget)


def _labels(key: Any) -> list[str]:
    if isinstance(key, tuple):
        return [str(key[0]), str(key[1])]
    return [str(key), ""]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
