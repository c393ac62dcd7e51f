"""The configured models: which are loaded, loading them on first use, unloading them.

`ModelPool` carries out `residency`'s policy on the event loop. Fetching, loading
and unloading run on worker threads; the decisions run on the loop, so they need no
locks of their own beyond `_changing`.

Invariants:
- a model is never unloaded while it is busy: a request holds it (`use`), waits
  for it, or still runs on its engine (`Loader.requests`);
- one load or unload runs at a time, so two loads never plan against the same
  free memory; fetching a model's files (a download, a GGUF import: minutes, maybe)
  comes first, outside that lock, so it holds up no other model's load or unload,
  and the plan counts the files fetched, not a guess made without them;
- with a budget, the loaded models' bytes as counted before loading stay within
  it: a model that cannot fit even alone beside the pinned ones is refused for good, one
  that must wait for busy models waits (bounded by `load_timeout`), and requests
  for a model that is loading wait for it (bounded too) rather than fail. A model
  that measures more once loaded than its files said unloads idle models after
  it; when the others are busy or pinned the total stays over until they end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from .lifecycle import (
    FetchUnavailable,
    Lifecycle,
    Loaded,
    Loader,
    ModelBusy,
    ModelTooLarge,
    ModelUnavailable,
    S,
    UnknownModel,
)
from .residency import Resident, expired, make_room
from .specs import ModelSpec

log = logging.getLogger("mlx_cache_server.models")

__all__ = [
    "FetchUnavailable", "Loaded", "Loader", "ModelBusy", "ModelPool", "ModelState",
    "ModelTooLarge", "ModelUnavailable", "UnknownModel",
]  # fmt: skip


@dataclass
class ModelState:
    """A configured model as /v1/models and /metrics show it."""

    spec: ModelSpec
    status: Literal["loaded", "loading", "unloaded"]
    bytes: int  # counted against the budget: measured when loaded, else estimated
    loads: int
    unloads: int
    load_seconds: float | None  # the last load's


class ModelPool(Lifecycle[S]):
    def __init__(
        self,
        specs: list[ModelSpec],
        loader: Loader[S],
        *,
        budget: int | None = None,
        load_timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not specs:
            raise ValueError("a server needs at least one model")
        self.specs = list(specs)
        self.loader, self.budget = loader, budget
        self.load_timeout, self.clock = load_timeout, clock
        self._names = {"default": specs[0]}
        for spec in specs:
            self._names.update(dict.fromkeys(spec.names(), spec))
        self._loaded: dict[str, Loaded[S]] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._wanted: Counter[str] = Counter()  # requests waiting in `use` for a model
        self._blocked: dict[str, list[str]] = {}  # a load waiting for busy models' room
        self._closed = False
        # Set once the server ends the requests still running (its shutdown grace over):
        # a stream still waiting for a load stops waiting (`server.loading`).
        self.stopping = threading.Event()
        self._changing = asyncio.Lock()
        self._fetches = ThreadPoolExecutor(8, thread_name_prefix="model-fetch")
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.load_seconds: dict[str, float] = {}

    # ------------------------------------------------------------ lookups

    @property
    def default(self) -> ModelSpec:
        return self.specs[0]

    def spec(self, name: str) -> ModelSpec:
        spec = self._names.get(name)
        if spec is None:
            raise UnknownModel(name)
        return spec

    def names(self, spec: ModelSpec) -> set[str]:
        return {n for n, s in self._names.items() if s is spec}

    def loaded(self) -> list[Loaded[S]]:
        return list(self._loaded.values())

    def get(self, name: str) -> S | None:
        """The model's served form if it is loaded, without loading it."""
        loaded = self._loaded.get(self.spec(name).id)
        return loaded.served if loaded is not None else None

    def states(self) -> list[ModelState]:
        out = []
        for spec in self.specs:
            loaded = self._loaded.get(spec.id)
            if loaded is not None:
                status, nbytes = "loaded", loaded.bytes
            else:
                status = "loading" if spec.id in self._loading else "unloaded"
                nbytes = self.loader.estimate(spec)
            out.append(
                ModelState(
                    spec, status, nbytes, self.loads[spec.id], self.unloads[spec.id],
                    self.load_seconds.get(spec.id),
                )
            )  # fmt: skip
        return out

    # ------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[S]:
        """The model `name` names, loaded if need be, held loaded while the block runs."""
        spec = self.spec(name)
        self._wanted[spec.id] += 1
        try:
            loaded = await self._ready(spec)
            loaded.leases += 1
        finally:
            self._wanted[spec.id] -= 1
        try:
            yield loaded.served
        finally:
            loaded.leases -= 1
            loaded.last_used = self.clock()

    async def load(self, name: str) -> ModelSpec:
        spec = self.spec(name)
        self._wanted[spec.id] += 1
        try:
            await self._ready(spec)
        finally:
            self._wanted[spec.id] -= 1
        return spec

    async def unload(self, name: str) -> bool:
        """Unload the model now; False if it was not loaded. Refused while it is busy."""
        spec = self.spec(name)
        if spec.id in self._loading:  # asked before the lock, which its load may hold
            raise ModelBusy(f"The model '{spec.id}' is loading; unload it once it is loaded.")
        async with self._changing:
            loaded = self._loaded.get(spec.id)
            if loaded is None:
                return False
            if spec.pinned:
                raise ModelBusy(f"The model '{spec.id}' is pinned: it stays loaded.")
            if self._busy(loaded):
                raise ModelBusy(
                    f"The model '{spec.id}' has requests running; unload it once they end."
                )
            await self._unload(spec.id, "asked")
        return True

    async def sweep(self) -> list[str]:
        """Unload the models idle for longer than their ttl; the ids unloaded."""
        now = self.clock()
        for loaded in self._loaded.values():
            if self._busy(loaded):
                loaded.last_used = now
        if not expired(self._residents(), now):
            return []
        gone = []
        async with self._changing:
            # One at a time, each decided afresh: while one unloads, a request may take
            # the next one on the list.
            while ids := expired(self._residents(), self.clock()):
                await self._unload(ids[0], "idle")
                gone.append(ids[0])
        return gone

    async def sweep_forever(self, every: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.sweep()
            except Exception:  # an unload that failed must not end the sweeping
                log.exception("idle unload failed")

    # ------------------------------------------------------- start and stop

    def open_now(self, name: str) -> ModelSpec:
        """Load a model before serving starts (no event loop yet, nothing else loading)."""
        spec = self.spec(name)
        if spec.id in self._loaded:
            return spec
        self.loader.fetch(spec)
        need = self.loader.estimate(spec)
        room = make_room(self._residents(), need, self.budget)
        if not room.fits or room.unload:
            raise ValueError(self._too_big(spec, need))
        t0 = time.perf_counter()
        self._register(spec, self.loader.open(spec), time.perf_counter() - t0)
        return spec

    def adopt(self, spec: ModelSpec, served: S) -> None:
        """Serve a model loaded elsewhere (a test's engine, say) as loaded."""
        self._loaded[spec.id] = Loaded(spec, served, self.loader.measure(served), self.clock())

    def close(self) -> None:
        """Unload everything (at shutdown); a load still running is undone when it ends."""
        self._closed = True
        self.stopping.set()
        self._fetches.shutdown(wait=False)  # a fetch under way ends on its own; none start
        for model_id in list(self._loaded):
            self._close(model_id, self._loaded.pop(model_id).served)
        self.loader.reclaim()

    # ------------------------------------------------------------ internals

    def _busy(self, loaded: Loaded[S]) -> bool:
        return (
            loaded.leases > 0
            or self._wanted[loaded.spec.id] > 0
            or self.loader.requests(loaded.served) > 0
        )

    def _residents(self) -> list[Resident]:
        return [
            Resident(m.spec.id, m.bytes, m.last_used, self._busy(m), m.spec.pinned, m.spec.ttl)
            for m in self._loaded.values()
        ]
