"""Which models to unload, for room or for being idle: the policy alone, on plain records."""

from __future__ import annotations

from mlx_cache_server.models.residency import Resident, expired, make_room


def r(id: str, nbytes: int, last_used: float, busy=False, pinned=False, ttl=None) -> Resident:
    return Resident(id, nbytes, last_used, busy, pinned, ttl)


def test_without_a_budget_everything_fits():
    room = make_room([r("a", 10**12, 0)], 10**12, None)
    assert room.fits and room.ever and room.unload == []


def test_room_that_is_free_unloads_nothing():
    assert make_room([r("a", 40, 0)], 60, 100).unload == []


def test_least_recently_used_idle_models_go_first_and_only_as_many_as_needed():
    residents = [r("new", 30, 9), r("old", 30, 1), r("mid", 30, 5)]
    room = make_room(residents, 40, 100)
    assert room.fits and room.unload == ["old"]
    assert make_room(residents, 70, 100).unload == ["old", "mid"]


def test_busy_and_pinned_models_are_never_chosen():
    residents = [r("busy", 30, 0, busy=True), r("pinned", 30, 1, pinned=True), r("idle", 30, 2)]
    room = make_room(residents, 40, 100)
    assert room.unload == ["idle"]
    # More than the idle one frees: wait for the busy one (it could fit once it is idle).
    waiting = make_room(residents, 70, 100)
    assert not waiting.fits and waiting.ever and waiting.unload == []


def test_a_model_that_cannot_fit_beside_the_pinned_ones_never_will():
    room = make_room([r("pinned", 60, 0, pinned=True), r("idle", 10, 0)], 50, 100)
    assert not room.fits and not room.ever
    assert make_room([], 101, 100).ever is False


def test_ttl_expiry_skips_busy_pinned_and_models_without_a_ttl():
    residents = [
        r("stale", 1, 0, ttl=60),
        r("fresh", 1, 50, ttl=60),
        r("busy", 1, 0, busy=True, ttl=60),
        r("pinned", 1, 0, pinned=True, ttl=60),
        r("kept", 1, 0),
    ]
    assert expired(residents, now=70) == ["stale"]
    assert expired(residents, now=110) == ["stale", "fresh"]
