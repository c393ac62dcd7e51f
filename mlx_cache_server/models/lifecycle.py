"""Loading and unloading one model for `ModelPool`: fetching its files, making room for
it under the memory budget, opening it on a worker thread, closing it.

`Lifecycle` is the pool's loader and unloader: it is handed the pool's loader, its
`Roster` (the loaded models), and the `stopping` event the pool shows the server. Its
methods run on the event loop, and the pool's invariants (its docstring) hold across
them: one load or unload runs at a time, under `changing`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol

from .residency import make_room
from .roster import Loaded, Roster, S
from .specs import ModelSpec

log = logging.getLogger("mlx_cache_server.models")

POLL = 0.05  # seconds between looks at busy models while a load waits for their room


class Loader(Protocol[S]):
    """How a model becomes servable and goes away again; blocking calls, run off the loop."""

    def fetch(self, spec: ModelSpec) -> None: ...  # its files here: download, import
    def open(self, spec: ModelSpec) -> S: ...
    # What it serves: "chat" or "embedding"; None: not known until its files are fetched.
    def kind(self, spec: ModelSpec) -> str | None: ...
    def close(self, served: S) -> None: ...  # stop serving it
    def reclaim(self) -> None: ...  # free what closed models held, once none is referenced
    def estimate(self, spec: ModelSpec) -> int: ...  # bytes it will count, from its files
    def measure(self, served: S) -> int: ...  # bytes it counts, once loaded
    def requests(self, served: S) -> int: ...  # requests running or queued on it


class UnknownModel(LookupError):
    pass


class ModelUnavailable(RuntimeError):
    """The model cannot be served now; `retry`: whether waiting may help."""

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


class FetchUnavailable(RuntimeError):
    """A model's files could not be fetched for now (no connection to the hub, the hub's own
    failure): unlike a model that does not exist, a later request may find them."""


class ModelTooLarge(ModelUnavailable):
    """The model cannot fit the budget even beside the pinned models alone: not now, not later."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry=False)


class ModelBusy(RuntimeError):
    pass


class Lifecycle(Generic[S]):
    def __init__(
        self,
        loader: Loader[S],
        roster: Roster[S],
        stopping: threading.Event,
        *,
        budget: int | None,
        load_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        """`stopping`: set at `close`, once the server ends the requests still running."""
        self.loader = loader
        self.roster = roster
        self.stopping = stopping
        self.budget, self.load_timeout, self.clock = budget, load_timeout, clock
        self.loading: dict[str, asyncio.Future] = {}  # by model id: its load under way
        self._blocked: dict[str, list[str]] = {}  # a load waiting for busy models' room
        self._closed = False
        self.changing = asyncio.Lock()  # held by each load and unload
        self._fetches = ThreadPoolExecutor(8, thread_name_prefix="model-fetch")
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.load_seconds: dict[str, float] = {}  # the last load's

    def open_now(self, spec: ModelSpec) -> None:
        """Load a model before serving starts (no event loop yet, nothing else loading)."""
        if spec.id in self.roster.loaded:
            return
        self.loader.fetch(spec)
        need = self.loader.estimate(spec)
        room = make_room(self.roster.residents(), need, self.budget)
        if not room.fits or room.unload:
            raise ValueError(self._too_big(spec, need))
        t0 = time.perf_counter()
        self._register(spec, self.loader.open(spec), time.perf_counter() - t0)

    def close(self) -> None:
        """Unload everything (at shutdown); a load still running is undone when it ends."""
        self._closed = True
        self.stopping.set()
        self._fetches.shutdown(wait=False)  # a fetch under way ends on its own; none start
        loaded = self.roster.loaded
        for model_id in list(loaded):
            self._close(model_id, loaded.pop(model_id).served)
        self.loader.reclaim()

    async def ready(self, spec: ModelSpec) -> Loaded[S]:
        """`spec`'s model once loaded: its load started if none is under way, waited for
        (bounded by `load_timeout`) without cancelling it when this waiter leaves."""
        deadline = time.monotonic() + self.load_timeout
        while (loaded := self.roster.loaded.get(spec.id)) is None:
            task = self.loading.get(spec.id)
            if task is None:
                task = asyncio.ensure_future(self._load(spec))
                self.loading[spec.id] = task
                task.add_done_callback(lambda t, key=spec.id: self._loaded_or_failed(key, t))
            try:
                # Shielded: a client that leaves does not cancel a load others wait for.
                await asyncio.wait_for(asyncio.shield(task), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                busy = self._blocked.get(spec.id)
                why = (
                    f": it waits for room that busy models hold ({', '.join(busy)})" if busy else ""
                )
                raise ModelUnavailable(
                    f"The model '{spec.id}' did not load within {self.load_timeout:g}s{why}; "
                    "retry shortly."
                ) from None
        return loaded

    def _loaded_or_failed(self, model_id: str, task: asyncio.Future) -> None:
        self.loading.pop(model_id, None)
        if not task.cancelled():
            task.exception()  # retrieved here: its waiters may all have timed out

    async def _load(self, spec: ModelSpec) -> None:
        """Fetch its files, then make room and load. The lock is held for each try at room
        and for the load itself, not while fetching nor while waiting for busy models:
        other models load and unload meanwhile."""
        await self._fetch(spec)
        deadline = time.monotonic() + self.load_timeout
        try:
            while True:
                async with self.changing:
                    if spec.id in self.roster.loaded:
                        return
                    if await self._room_for(spec):
                        await self._open(spec)
                        return
                if time.monotonic() >= deadline:
                    busy = ", ".join(self._blocked.get(spec.id, []))
                    raise ModelUnavailable(
                        f"The model '{spec.id}' needs room that busy models hold ({busy}); "
                        "retry when they are idle."
                    )
                await asyncio.sleep(POLL)
        finally:
            self._blocked.pop(spec.id, None)

    async def _room_for(self, spec: ModelSpec) -> bool:
        """Unload what must go for `spec` to fit, one model at a time and each decided
        afresh (a request may take one while another unloads); False: busy models hold
        the room."""
        need = self.loader.estimate(spec)
        while True:
            room = make_room(self.roster.residents(), need, self.budget)
            if not room.ever:
                raise ModelTooLarge(self._too_big(spec, need))
            if not room.fits:
                self._blocked[spec.id] = [r.id for r in self.roster.residents() if r.busy]
                return False
            if not room.unload:
                return True
            await self.unload(room.unload[0], f"room for {spec.id}")

    async def _fetch(self, spec: ModelSpec) -> None:
        try:
            # Threads of their own: a fetch waiting for another model's download must not
            # hold a worker the loop's executor gives every request's templating.
            await asyncio.get_running_loop().run_in_executor(self._fetches, self.loader.fetch, spec)
        except Exception as e:
            log.exception("fetching model %s failed", spec.id)
            raise ModelUnavailable(
                f"The model '{spec.id}' could not be fetched: {e}",
                retry=isinstance(e, FetchUnavailable),
            ) from e
        if self._closed:
            raise ModelUnavailable("The server is shutting down.")

    async def _open(self, spec: ModelSpec) -> None:
        log.info("loading model %s", spec.id)
        t0 = time.perf_counter()
        try:
            served = await asyncio.to_thread(self.loader.open, spec)
        except Exception as e:
            log.exception("loading model %s failed", spec.id)
            raise ModelUnavailable(
                f"The model '{spec.id}' could not be loaded: {e}", retry=False
            ) from e
        if self._closed:  # the server stopped while it loaded
            await asyncio.to_thread(self._close, spec.id, served)
            raise ModelUnavailable("The server is shutting down.")
        self._register(spec, served, time.perf_counter() - t0)
        # Counted before loading from its files, a model may measure more once loaded.
        loaded = self.roster.loaded
        while self.budget is not None and sum(m.bytes for m in loaded.values()) > self.budget:
            others = [r for r in self.roster.residents() if r.id != spec.id]
            room = make_room(others, loaded[spec.id].bytes, self.budget)
            if not (room.fits and room.unload):
                log.warning(
                    "loaded models count more than the %d MiB budget: %s measured more than "
                    "its files, and the others are busy or pinned", self.budget >> 20, spec.id,
                )  # fmt: skip
                break
            await self.unload(room.unload[0], f"room for {spec.id}, as measured")

    def _register(self, spec: ModelSpec, served: S, seconds: float) -> None:
        loaded = Loaded(spec, served, self.loader.measure(served), self.clock())
        self.roster.loaded[spec.id] = loaded
        self.loads[spec.id] += 1
        self.load_seconds[spec.id] = seconds
        log.info("model %s loaded in %.1fs (%d MiB counted)", spec.id, seconds, loaded.bytes >> 20)

    async def unload(self, model_id: str, reason: str) -> None:
        """Close a loaded model and free what it held; called under `changing`."""
        served = self.roster.loaded.pop(model_id).served
        self.unloads[model_id] += 1
        log.info("unloading model %s (%s)", model_id, reason)
        await asyncio.to_thread(self._close, model_id, served)
        # Its arrays sit in reference cycles (engine, batch, serving classes): only a
        # collection frees them, and only once this frame lets go of them.
        del served
        await asyncio.to_thread(self.loader.reclaim)

    def _close(self, model_id: str, served: S) -> None:
        try:
            self.loader.close(served)
        except Exception:  # out of the list already: no request reaches it, so it is unloaded
            log.exception("closing model %s failed; it counts as unloaded", model_id)

    def _too_big(self, spec: ModelSpec, need: int) -> str:
        pinned = sum(m.bytes for m in self.roster.loaded.values() if m.spec.pinned)
        return (
            f"The model '{spec.id}' needs {need >> 20} MiB, and the memory budget is "
            f"{(self.budget or 0) >> 20} MiB with {pinned >> 20} MiB of it pinned: it cannot "
            "fit. Raise --memory-budget or unpin a model."
        )
