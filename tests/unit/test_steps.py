"""A step's inputs: read once (`LocalSteps`), and handed from rank 0 to the other ranks of a
sharded server (`LeaderSteps`, `FollowerSteps`) over a fake wire instead of `mx.distributed`."""

from __future__ import annotations

import pickle
import queue
from dataclasses import replace

import pytest

from mlx_cache_server.engine import SamplingParams, sharded_steps
from mlx_cache_server.engine.request import Request
from mlx_cache_server.engine.sharded_steps import Diverged, FollowerSteps, LeaderSteps
from mlx_cache_server.engine.steps import LocalSteps, Measured
from tests.helpers import FakeClock


def request(tokens=(1, 2, 3), **params) -> Request:
    return Request(list(tokens), SamplingParams(max_tokens=8, **params), lambda e: None, "m")


def local() -> tuple[LocalSteps, queue.Queue, FakeClock]:
    inbox: queue.Queue = queue.Queue()
    clock = FakeClock()
    return LocalSteps(inbox, clock), inbox, clock


def test_a_request_is_new_once_and_cancelled_once_after_it_was_taken():
    steps, inbox, clock = local()
    a = request()
    a.cancel()  # before the engine took it: cancelled in the same step it is new
    inbox.put(a)
    clock.advance(5)
    first = steps.next(busy=True)
    assert first.new == [a] and first.cancelled == [a] and first.now == clock()
    a.cancelled = True  # the engine applied it
    assert steps.next(busy=True).empty


def test_a_cancellation_of_an_ended_request_is_not_passed_on():
    steps, inbox, _ = local()
    a = request()
    inbox.put(a)
    steps.next(busy=True)
    a.ended = True
    a.cancel()
    assert steps.next(busy=True).cancelled == []


def test_the_measured_cost_and_a_flush_go_into_the_next_step_only():
    steps, _, _ = local()
    steps.measured(Measured(0.5, 100, True))
    steps.flush_asked.set()
    inputs = steps.next(busy=True)
    assert inputs.measured == Measured(0.5, 100, True) and inputs.flush
    again = steps.next(busy=True)
    assert again.measured is None and not again.flush and again.empty


class Wire:
    """What rank 0 broadcasts, read back by a follower in order."""

    def __init__(self) -> None:
        self.sent: list = []

    def broadcast(self, group, obj):
        if obj is not None:
            self.sent.append(pickle.dumps(obj))  # as `sharded_steps.broadcast` sends it
            return obj
        return pickle.loads(self.sent.pop(0))


class Group:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank


class Grammar:
    def __init__(self, grammar: str) -> None:
        self.grammar = grammar


@pytest.fixture
def wire(monkeypatch) -> Wire:
    w = Wire()
    monkeypatch.setattr(sharded_steps, "broadcast", w.broadcast)
    monkeypatch.setattr(sharded_steps, "build_constraint", lambda grammars, g: Grammar(g))
    return w


def test_a_follower_gets_the_leaders_requests_seeds_cancellations_and_costs(wire):
    steps, inbox, clock = local()
    leader = LeaderSteps(steps, Group(0), cache=None)
    follower = FollowerSteps(Group(1), cache=None, grammars=None)
    sampled = request((4, 5), temperature=0.7)
    constrained = request((6,), temperature=0.0)
    constrained.params = replace(constrained.params, constraint=Grammar("start: 'x'"))
    inbox.put(sampled)
    inbox.put(constrained)
    clock.advance(3)
    sent = leader.next(busy=False)
    got = follower.next(busy=False)
    assert [r.rid for r in got.new] == [sampled.rid, constrained.rid]
    assert [r.tokens for r in got.new] == [[4, 5], [6]]
    assert got.now == sent.now == clock()
    # No seed asked for: rank 0 drew one, the same for every rank.
    assert sampled.params.seed is not None and got.new[0].params.seed == sampled.params.seed
    assert got.new[1].params.constraint.grammar == "start: 'x'"  # built again, from its text
    assert got.new[0].cache_key == "m"

    sampled.cancel()
    leader.measured(Measured(0.25, 64, True, 1234.5))
    leader.next(busy=True)
    got = follower.next(busy=True)
    assert [r.rid for r in got.cancelled] == [sampled.rid]
    assert got.measured == Measured(0.25, 64, True, 1234.5)


def test_an_idle_leader_with_nothing_new_sends_nothing(wire):
    steps, _, _ = local()
    steps.inbox.put(None)  # a wake-up, no request
    LeaderSteps(steps, Group(0), cache=None).next(busy=False)
    assert wire.sent == []


def test_a_busy_leader_sends_every_step_even_with_nothing_new(wire):
    """The others run a step only when told: each step of a running batch is sent."""
    steps, _, _ = local()
    leader = LeaderSteps(steps, Group(0), cache=None)
    follower = FollowerSteps(Group(1), cache=None, grammars=None)
    for _ in range(3):
        leader.next(busy=True)
        assert follower.next(busy=True).empty
    assert wire.sent == []


def test_an_idle_release_reaches_every_rank_once(wire):
    steps, _, _ = local()
    leader = LeaderSteps(steps, Group(0), cache=None)
    follower = FollowerSteps(Group(1), cache=None, grammars=None)
    steps.release_asked.set()  # the engine's pause
    assert leader.next(busy=False).release
    assert follower.next(busy=False).release
    leader.next(busy=False)
    assert wire.sent == []  # once: nothing more is sent while idle


def test_a_follower_whose_cache_differs_from_the_leaders_stops(wire, monkeypatch):
    steps, inbox, _ = local()
    leader = LeaderSteps(steps, Group(0), cache=None)
    follower = FollowerSteps(Group(1), cache=None, grammars=None)
    inbox.put(request())
    leader.next(busy=False)
    monkeypatch.setattr(sharded_steps, "step_digest", lambda cache, stats: (1, 2, 3))
    with pytest.raises(Diverged):
        follower.next(busy=False)


def test_a_follower_that_failed_a_request_the_leader_ran_stops(wire):
    """A failure of one rank's own (out of memory, say) parts it from the others."""
    from mlx_cache_server.engine import EngineStats

    steps, inbox, _ = local()
    leader = LeaderSteps(steps, Group(0), cache=None, stats=EngineStats(admitted=1))
    follower = FollowerSteps(Group(1), cache=None, grammars=None,
                             stats=EngineStats(admitted=1, failed=1))  # fmt: skip
    inbox.put(request())
    leader.next(busy=False)
    with pytest.raises(Diverged):
        follower.next(busy=False)
