"""Admission planning alone: which new requests run now and which wait for a shared prefix."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_cache_server.engine.admission import plan_admission

SYSTEM = list(range(100, 160))  # a 60-token prefix nothing has cached


@dataclass(eq=False)
class Req:
    tokens: list[int]
    cache_key: str = "m"
    name: str = field(default="", compare=False)


def plan(new, prefilling=(), cached=None, min_shared=32):
    cached = cached or {}
    return plan_admission(new, list(prefilling), lambda r: cached.get(r.name, 0), min_shared)


def test_requests_with_nothing_worth_sharing_are_all_admitted():
    a, b = Req([1, 2, 3, 4]), Req([1, 2, 3, 5])  # 3 shared tokens: under min_shared
    p = plan([a, b])
    assert p.admit == [a, b] and p.leader_of == {} and p.boundary == {}


def test_the_first_of_several_sharing_an_uncached_prefix_leads_and_is_cut_there():
    a, b, c = (Req([*SYSTEM, i, i + 1]) for i in (1, 2, 3))
    p = plan([a, b, c])
    assert p.admit == [a]
    assert p.leader_of == {b: a, c: a}
    assert p.boundary == {a: len(SYSTEM)}


def test_the_cut_is_where_the_shortest_sharing_ends():
    a = Req([*SYSTEM, 7, 7, 7, 1])
    b = Req([*SYSTEM, 7, 7, 7, 2])  # shares 63 tokens with a
    c = Req([*SYSTEM[:40], 9, 9])  # shares 40
    p = plan([a, b, c])
    assert p.admit == [a] and p.boundary == {a: 40}


def test_a_prefix_the_cache_already_holds_is_not_worth_waiting_for():
    a, b = Req([*SYSTEM, 1], name="a"), Req([*SYSTEM, 2], name="b")
    p = plan([a, b], cached={"a": 50, "b": 50})  # 60 shared, 50 cached: 10 new < 32
    assert p.admit == [a, b] and not p.leader_of


def test_tenants_never_share_a_prefix():
    a, b = Req([*SYSTEM, 1], cache_key="tenant-a"), Req([*SYSTEM, 2], cache_key="tenant-b")
    assert plan([a, b]).admit == [a, b]


def test_a_request_already_prefilling_can_lead_and_keeps_its_own_cut():
    running = Req([*SYSTEM, 1])
    new = Req([*SYSTEM, 2])
    p = plan([new], prefilling=[running])
    assert p.admit == [] and p.leader_of == {new: running} and p.boundary == {}


def test_sharing_always_leaves_a_token_of_each_prompt_to_run():
    a = Req(list(SYSTEM))
    b = Req([*SYSTEM, 5])  # a is a prefix of b
    p = plan([a, b])
    assert p.leader_of == {b: a} and p.boundary == {a: len(SYSTEM) - 1}


def test_the_longest_sharing_leader_wins():
    short = Req([*SYSTEM[:40], 1, 1])
    long = Req([*SYSTEM, 2, 2])
    new = Req([*SYSTEM, 3, 3])
    p = plan([new], prefilling=[short, long])
    assert p.leader_of == {new: long}
