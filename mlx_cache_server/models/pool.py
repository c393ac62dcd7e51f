"""The configured models: which are loaded, loading them on first use, unloading them.

`ModelPool` carries out `residency`'s policy on the event loop, with its `Roster` (the
loaded models, and who holds or waits for each) and its `Lifecycle` (loading and
unloading one). Fetching, loading and unloading run on worker threads; the decisions
run on the loop, so they need no locks of their own beyond `Lifecycle.changing`.

Invariants:
- a model is never unloaded while it is busy: a request holds it (`use`), waits
  for it, or still runs on its engine (`Loader.requests`: `Roster.busy`);
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
from dataclasses import dataclass
from typing import Generic, Literal

from .lifecycle import (
    FetchUnavailable,
    Lifecycle,
    Loader,
    ModelBusy,
    ModelTooLarge,
    ModelUnavailable,
    S,
    UnknownModel,
)
from .residency import expired
from .roster import Loaded, Roster
from .specs import ModelNames, ModelSpec

log = logging.getLogger("mlx_cache_server.models")
# The names no model has that were answered by the default model, logged once each: past
# this many the record starts afresh (clients may send any number of names).
ANSWERED_LOGGED = 1024

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


class ModelPool(Generic[S]):
    """The configured models, looked up by name, leased to requests (`use`), loaded and
    unloaded by its `lifecycle`, which is handed the pool's loader and `roster`."""

    def __init__(
        self,
        specs: list[ModelSpec],
        loader: Loader[S],
        *,
        budget: int | None = None,
        load_timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        answer_any: Literal["auto", "on", "off"] = "off",
    ) -> None:
        """`answer_any`: whether a name no model has means the default model (`answering`);
        "auto": when it is the only model."""
        if not specs:
            raise ValueError("a server needs at least one model")
        self.specs = list(specs)
        self.loader, self.clock = loader, clock
        self._names = {"default": specs[0]}
        for spec in specs:
            self._names.update(dict.fromkeys(spec.names(), spec))
        self.roster: Roster[S] = Roster(loader.requests)
        self.answer_any = answer_any == "on" or (answer_any == "auto" and len(specs) == 1)
        self._answered: set[str] = set()  # names no model has, answered and logged
        # Set once the server ends the requests still running (its shutdown grace over):
        # a stream still waiting for a load stops waiting (`server.while_loading`).
        self.stopping = threading.Event()
        self.lifecycle = Lifecycle(
            loader, self.roster, self.stopping,
            budget=budget, load_timeout=load_timeout, clock=clock,
        )  # fmt: skip

    @property
    def budget(self) -> int | None:
        """The loaded models' memory budget in bytes; None: no budget."""
        return self.lifecycle.budget

    @property
    def loads(self) -> Counter[str]:
        """Loads of each model, by id."""
        return self.lifecycle.loads

    @property
    def unloads(self) -> Counter[str]:
        """Unloads of each model, by id."""
        return self.lifecycle.unloads

    # ------------------------------------------------------------ lookups

    @property
    def default(self) -> ModelSpec:
        return self.specs[0]

    def spec(self, name: str) -> ModelSpec:
        spec = self._names.get(name)
        if spec is None:
            raise UnknownModel(name)
        return spec

    def knows(self, name: str) -> bool:
        """Whether a model has the name (its id, folder name, an alias, or `default`)."""
        return name in self._names

    def names(self, spec: ModelSpec) -> set[str]:
        return {n for n, s in self._names.items() if s is spec}

    def naming(self, spec: ModelSpec) -> ModelNames:
        """The names a request may use for the model: `names`, and for the default model
        when names no model has are answered (`answer_any`), those too."""
        answers = self.answer_any and spec is self.default
        return ModelNames(frozenset(self.names(spec)), frozenset(self._names) if answers else None)

    def answering(self, name: str, always: bool = False) -> str:
        """The name to look the model `name` means up by: itself, if a model has it;
        `default`, if names no model has are answered by the default model (`answer_any`,
        or `always`: the caller's API does so whatever the setting), logged once per name;
        else itself, which `spec` refuses."""
        if self.knows(name) or not (self.answer_any or always):
            return name
        if name not in self._answered:
            if len(self._answered) >= ANSWERED_LOGGED:
                self._answered.clear()
            self._answered.add(name)
            log.info(
                "model %r is not served here: the default model, %s, answers it",
                name, self.default.id,
            )  # fmt: skip
        return "default"

    def loaded(self) -> list[Loaded[S]]:
        return list(self.roster.loaded.values())

    def get(self, name: str) -> S | None:
        """The model's served form if it is loaded, without loading it."""
        loaded = self.roster.loaded.get(self.spec(name).id)
        return loaded.served if loaded is not None else None

    def states(self) -> list[ModelState]:
        life = self.lifecycle
        out = []
        for spec in self.specs:
            loaded = self.roster.loaded.get(spec.id)
            if loaded is not None:
                status, nbytes = "loaded", loaded.bytes
            else:
                status = "loading" if spec.id in life.loading else "unloaded"
                nbytes = self.loader.estimate(spec)
            out.append(
                ModelState(
                    spec, status, nbytes, self.loads[spec.id], self.unloads[spec.id],
                    life.load_seconds.get(spec.id),
                )
            )  # fmt: skip
        return out

    # ------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[S]:
        """The model `name` names, loaded if need be, held loaded while the block runs."""
        spec = self.spec(name)
        wanted = self.roster.wanted
        wanted[spec.id] += 1
        try:
            loaded = await self.lifecycle.ready(spec)
            loaded.leases += 1
        finally:
            wanted[spec.id] -= 1
        try:
            yield loaded.served
        finally:
            loaded.leases -= 1
            loaded.last_used = self.clock()

    async def load(self, name: str) -> ModelSpec:
        spec = self.spec(name)
        wanted = self.roster.wanted
        wanted[spec.id] += 1
        try:
            await self.lifecycle.ready(spec)
        finally:
            wanted[spec.id] -= 1
        return spec

    async def unload(self, name: str) -> bool:
        """Unload the model now; False if it was not loaded. Refused while it is busy."""
        spec, life = self.spec(name), self.lifecycle
        if spec.id in life.loading:  # asked before the lock, which its load may hold
            raise ModelBusy(f"The model '{spec.id}' is loading; unload it once it is loaded.")
        async with life.changing:
            loaded = self.roster.loaded.get(spec.id)
            if loaded is None:
                return False
            if spec.pinned:
                raise ModelBusy(f"The model '{spec.id}' is pinned: it stays loaded.")
            if self.roster.busy(loaded):
                raise ModelBusy(
                    f"The model '{spec.id}' has requests running; unload it once they end."
                )
            await life.unload(spec.id, "asked")
        return True

    async def sweep(self) -> list[str]:
        """Unload the models idle for longer than their ttl; the ids unloaded."""
        now, roster = self.clock(), self.roster
        for loaded in roster.loaded.values():
            if roster.busy(loaded):
                loaded.last_used = now
        if not expired(roster.residents(), now):
            return []
        gone = []
        async with self.lifecycle.changing:
            # One at a time, each decided afresh: while one unloads, a request may take
            # the next one on the list.
            while ids := expired(roster.residents(), self.clock()):
                await self.lifecycle.unload(ids[0], "idle")
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
        self.lifecycle.open_now(spec)
        return spec

    def adopt(self, spec: ModelSpec, served: S) -> None:
        """Serve a model loaded elsewhere (a test's engine, say) as loaded."""
        self.roster.loaded[spec.id] = Loaded(
            spec, served, self.loader.measure(served), self.clock()
        )

    def close(self) -> None:
        """Unload everything (at shutdown); a load still running is undone when it ends."""
        self.lifecycle.close()
