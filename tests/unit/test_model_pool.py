"""`ModelPool` with a fake loader: loads once on use, waits rather than unloading a busy
model, refuses what cannot fit, and unloads after the ttl on its clock."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from mlx_cache_server.models.pool import (
    FetchUnavailable,
    ModelBusy,
    ModelPool,
    ModelTooLarge,
    ModelUnavailable,
    UnknownModel,
)
from mlx_cache_server.models.specs import ModelSpec


@dataclass(eq=False)
class Fake:
    spec: ModelSpec
    requests: int = 0


@dataclass
class FakeLoader:
    sizes: dict[str, int]
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)  # held: loads block
    fail: set[str] = field(default_factory=set)
    slow_close: dict[str, threading.Event] = field(default_factory=dict)  # closes that wait
    closed_busy: list[str] = field(default_factory=list)  # closed under a running request
    close_fails: set[str] = field(default_factory=set)
    # Models whose files are not here yet (a hub id, a GGUF file not imported): what they
    # count until fetched.
    unfetched: dict[str, int] = field(default_factory=dict)
    fetched: set[str] = field(default_factory=set)
    slow_fetch: dict[str, threading.Event] = field(default_factory=dict)  # fetches that wait
    events: list[str] = field(default_factory=list)  # "fetch b", "open b", "close a", in order
    fetch_errors: dict[str, Exception] = field(default_factory=dict)  # fetches that fail so

    def __post_init__(self) -> None:
        self.gate.set()

    def fetch(self, spec: ModelSpec) -> None:
        if spec.id in self.slow_fetch:
            self.slow_fetch[spec.id].wait(10)
        if spec.id in self.fetch_errors:
            raise self.fetch_errors[spec.id]
        self.events.append(f"fetch {spec.id}")
        self.fetched.add(spec.id)

    def open(self, spec: ModelSpec) -> Fake:
        self.gate.wait(10)
        if spec.id in self.fail:
            raise OSError(f"no weights for {spec.id}")
        if spec.id not in self.fetched:  # as mlx-lm's load would, fetching what is missing
            self.fetch(spec)
        self.events.append(f"open {spec.id}")
        self.opened.append(spec.id)
        return Fake(spec)

    def kind(self, spec: ModelSpec) -> str:
        return "chat"

    def close(self, served: Fake) -> None:
        if served.requests:
            self.closed_busy.append(served.spec.id)
        self.closed.append(served.spec.id)
        self.events.append(f"close {served.spec.id}")
        if served.spec.id in self.slow_close:
            self.slow_close[served.spec.id].wait(10)
        if served.spec.id in self.close_fails:
            raise RuntimeError(f"{served.spec.id}'s engine would not stop")

    def reclaim(self) -> None:
        pass

    def estimate(self, spec: ModelSpec) -> int:
        if spec.id in self.unfetched and spec.id not in self.fetched:
            return self.unfetched[spec.id]
        return self.sizes[spec.id]

    def measure(self, served: Fake) -> int:
        return self.sizes[served.spec.id]

    def requests(self, served: Fake) -> int:
        return served.requests


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SPECS = [
    ModelSpec("a", "/a", aliases=("alpha",)),
    ModelSpec("b", "/b", ttl=60),
    ModelSpec("p", "/p", pinned=True),
    ModelSpec("c", "/c"),
]


def pool(budget=None, **kw) -> tuple[ModelPool, FakeLoader]:
    loader = FakeLoader({"a": 40, "b": 40, "p": 30, "c": 20, **kw.pop("sizes", {})})
    return ModelPool(SPECS, loader, budget=budget, **kw), loader


def run(coro):
    return asyncio.run(coro)


def test_names_resolve_to_their_model_and_unknown_names_are_refused():
    p, _ = pool()
    assert p.spec("alpha").id == "a" and p.spec("default").id == "a" and p.spec("b").id == "b"
    with pytest.raises(UnknownModel):
        p.spec("gpt-5")


@pytest.mark.parametrize(
    "setting, models, answered",
    [("auto", 1, True), ("auto", 2, False), ("on", 2, True), ("off", 1, False)],
)
def test_a_name_no_model_has_is_the_default_models_where_the_setting_says(
    setting, models, answered, caplog
):
    p = ModelPool(SPECS[:models], FakeLoader({"a": 40, "b": 40}), answer_any=setting)
    with caplog.at_level("INFO", logger="mlx_cache_server.models"):
        for _ in range(2):
            assert p.answering("gpt-5") == ("default" if answered else "gpt-5")
        assert p.answering("alpha") == "alpha"  # a model's own name is its own
    assert len([r for r in caplog.records if "gpt-5" in r.getMessage()]) == int(answered)
    assert p.answering("claude-x", always=True) == "default"  # whatever the setting
    assert ("gpt-5" in p.naming(p.default)) is answered and "alpha" in p.naming(p.default)
    if models > 1:  # another model's names are never the default's, nor any others
        assert "b" not in p.naming(p.default) and "gpt-5" not in p.naming(p.spec("b"))


def test_concurrent_requests_for_an_unloaded_model_load_it_once():
    p, loader = pool()
    loader.gate.clear()

    async def main():
        async def ask():
            async with p.use("b") as served:
                return served

        tasks = [asyncio.ensure_future(ask()) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert [s.status for s in p.states() if s.spec.id == "b"] == ["loading"]
        loader.gate.set()
        return await asyncio.gather(*tasks)

    served = run(main())
    assert loader.opened == ["b"] and len({id(s) for s in served}) == 1


def test_room_is_made_by_unloading_the_least_recently_used_idle_model():
    clock = Clock()
    p, loader = pool(budget=100, clock=clock)

    async def main():
        for name in ("a", "b"):
            async with p.use(name):
                clock.now += 1
        async with p.use("p"):  # 30 more: a (used first) goes
            pass

    run(main())
    assert loader.closed == ["a"] and {m.spec.id for m in p.loaded()} == {"b", "p"}


def test_a_busy_model_is_never_unloaded_the_load_waits_for_it():
    p, loader = pool(budget=50)

    async def main():
        order = []
        async with p.use("a") as a:
            a.requests = 1  # a stream still running on its engine after the lease

        async def finish_a_later():
            await asyncio.sleep(0.3)
            order.append("a done")
            a.requests = 0

        async def want_b():
            async with p.use("b"):
                order.append("b served")

        await asyncio.gather(finish_a_later(), want_b())
        return order

    assert run(main()) == ["a done", "b served"]
    assert loader.closed == ["a"]


def test_waiting_for_room_is_bounded():
    p, loader = pool(budget=50, load_timeout=1.0)

    async def main():
        async with p.use("a") as a:
            with pytest.raises(ModelUnavailable) as e:
                async with p.use("b"):
                    pass
            assert e.value.retry and "busy" in str(e.value)
            assert a is p.get("a")

    run(main())
    assert loader.closed == []


def test_a_model_larger_than_the_budget_beside_the_pinned_ones_is_refused_at_once():
    p, _ = pool(budget=60)
    p.open_now("p")

    async def main():
        with pytest.raises(ModelTooLarge) as e:  # for good: no waiting makes room for it
            async with p.use("a"):
                pass
        assert not e.value.retry and "cannot fit" in str(e.value)

    run(main())


def test_a_failed_load_fails_its_requests_and_the_next_request_tries_again():
    p, loader = pool()
    loader.fail.add("b")

    async def main():
        with pytest.raises(ModelUnavailable) as e:
            async with p.use("b"):
                pass
        assert "no weights" in str(e.value)
        loader.fail.clear()
        async with p.use("b") as served:
            return served

    assert run(main()).spec.id == "b"


def test_a_fetch_failed_for_now_may_be_retried_and_one_that_cannot_succeed_may_not():
    p, loader = pool()
    loader.unfetched["b"] = loader.unfetched["c"] = 0
    loader.fetch_errors["b"] = FetchUnavailable("hub unreachable")
    loader.fetch_errors["c"] = ValueError("not a GGUF file")

    async def refusal(name: str) -> ModelUnavailable:
        with pytest.raises(ModelUnavailable) as e:
            async with p.use(name):
                pass
        return e.value

    async def main() -> tuple[ModelUnavailable, ModelUnavailable]:
        return await refusal("b"), await refusal("c")

    now, never = run(main())
    assert now.retry and "hub unreachable" in str(now)
    assert not never.retry and "not a GGUF file" in str(never)


def test_unload_is_refused_while_busy_and_for_pinned_models():
    p, loader = pool()
    p.open_now("a")
    p.open_now("p")

    async def main():
        p.get("a").requests = 1
        with pytest.raises(ModelBusy):
            await p.unload("a")
        with pytest.raises(ModelBusy):
            await p.unload("p")
        p.get("a").requests = 0
        assert await p.unload("a") is True
        assert await p.unload("a") is False

    run(main())
    assert loader.closed == ["a"]


def test_ttl_unloads_an_idle_model_on_the_pools_clock_and_a_busy_one_stays():
    clock = Clock()
    p, loader = pool(clock=clock)

    async def main():
        async with p.use("b"):
            pass
        clock.now += 59
        assert await p.sweep() == []
        p.get("b").requests = 1  # busy at the sweep: its idle time starts afresh
        clock.now += 30
        assert await p.sweep() == []
        p.get("b").requests = 0
        clock.now += 59
        assert await p.sweep() == []
        clock.now += 2
        assert await p.sweep() == ["b"]

    run(main())
    assert loader.closed == ["b"]


def test_a_model_taken_while_another_unloads_for_room_is_not_unloaded_after_it():
    p, loader = pool(budget=100, sizes={"c": 90})
    closing_a = loader.slow_close["a"] = threading.Event()

    async def main():
        for name in ("a", "b"):  # both loaded, idle; c needs both gone
            async with p.use(name):
                pass

        async def want_c():
            async with p.use("c"):
                pass

        load_c = asyncio.ensure_future(want_c())
        while "a" not in loader.closed:  # a is being unloaded for c, b is next on the list
            await asyncio.sleep(0.01)
        async with p.use("b") as b:  # a request takes b meanwhile, and streams on it
            b.requests = 1
        closing_a.set()
        await asyncio.sleep(0.3)
        assert not load_c.done() and p.get("b") is b  # c waits for b's room
        b.requests = 0
        await load_c

    run(main())
    assert loader.closed_busy == [] and loader.closed == ["a", "b"]


def test_a_load_waiting_for_room_lets_a_model_that_fits_load_meanwhile():
    p, loader = pool(budget=100, sizes={"b": 70}, load_timeout=5)

    async def main():
        async with p.use("a") as a:
            a.requests = 1  # busy: b (70) cannot get its room until a ends

        waiting_b = asyncio.ensure_future(p.load("b"))
        await asyncio.sleep(0.2)
        async with p.use("c"):  # 20 fits beside a (40) now: b's wait does not hold it up
            pass
        assert not waiting_b.done()
        a.requests = 0
        await waiting_b

    run(main())
    assert loader.opened == ["a", "c", "b"] and loader.closed == ["a"]  # c still fits beside b


def test_unloading_a_model_that_is_loading_is_refused_at_once():
    p, loader = pool()
    loader.gate.clear()

    async def main():
        loading = asyncio.ensure_future(p.load("b"))
        await asyncio.sleep(0.05)
        with pytest.raises(ModelBusy, match="loading"):
            await asyncio.wait_for(p.unload("b"), 1)  # not after the load, which holds the lock
        loader.gate.set()
        await loading

    run(main())


def test_a_close_that_fails_still_unloads_the_model():
    p, loader = pool(budget=100, sizes={"c": 70})
    loader.close_fails.update({"a", "b"})
    p.open_now("a")
    p.open_now("b")

    async def main():
        assert await p.unload("a") is True  # logged, not raised: it is out of the list
        assert p.get("a") is None and p.unloads["a"] == 1
        async with p.use("c"):  # 70 beside b's 40: b goes for room, its close fails too
            pass
        async with p.use("a"):  # and a loads again (c goes for it)
            pass

    run(main())
    assert loader.closed == ["a", "b", "c"] and [m.spec.id for m in p.loaded()] == ["a"]
    p.close()  # at shutdown too: the others are still closed
    assert p.loaded() == [] and loader.closed[-1] == "a"


def test_a_model_is_fetched_before_its_room_is_planned_from_its_files():
    # c is a hub id not downloaded yet: 0 bytes until fetched, 90 after.
    p, loader = pool(budget=100, sizes={"c": 90})
    loader.unfetched["c"] = 0
    p.open_now("a")
    p.open_now("b")

    async def main():
        async with p.use("c"):
            pass

    run(main())
    # Room made for 90 before c loads, not found missing after it.
    assert loader.events[-4:] == ["fetch c", "close a", "close b", "open c"]


def test_a_model_fetched_at_start_is_counted_as_its_files_say():
    p, loader = pool(budget=100, sizes={"c": 110})
    loader.unfetched["c"] = 10  # a GGUF file, say, that its import makes larger
    with pytest.raises(ValueError, match="cannot fit"):
        p.open_now("c")
    assert loader.events == ["fetch c"]


def test_a_slow_fetch_holds_up_no_other_models_loads_or_unloads():
    p, loader = pool()
    downloading = loader.slow_fetch["b"] = threading.Event()
    p.open_now("a")

    async def main():
        load_b = asyncio.ensure_future(p.load("b"))
        await asyncio.sleep(0.1)  # b's download is under way
        assert [s.status for s in p.states() if s.spec.id == "b"] == ["loading"]
        assert await asyncio.wait_for(p.unload("a"), 2) is True  # answers meanwhile
        async with asyncio.timeout(2):
            async with p.use("c"):  # and another model loads meanwhile
                pass
        assert not load_b.done()
        downloading.set()
        await load_b

    run(main())
    assert loader.events[2:] == ["close a", "fetch c", "open c", "fetch b", "open b"]


def test_a_model_loaded_as_the_server_stops_is_closed_even_if_its_close_fails():
    p, loader = pool()
    loader.gate.clear()
    loader.close_fails.add("b")

    async def main():
        load = asyncio.ensure_future(p.load("b"))
        await asyncio.sleep(0.1)  # b is loading
        p.close()
        loader.gate.set()
        with pytest.raises(ModelUnavailable, match="shutting down"):  # not the close's error
            await load

    run(main())
    assert loader.closed == ["b"] and p.loaded() == []
