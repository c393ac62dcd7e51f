"""Which new requests to admit now, and which wait for a prefix another one computes.

When several requests share a prefix the cache does not hold yet (16 chats
opening with one system prompt, say), the first one (the leader) is admitted
with its prompt cut where the sharing ends; once that prefix is prefilled and
cached, the others (its followers) are admitted and reuse it, instead of each
prefilling it in parallel. This module only decides; the batch carries it out.

Invariants of a plan: every new request is either admitted or follows exactly
one leader; a leader is a request already prefilling or one admitted in this
plan; requests of different cache keys (tenants) never share; a follower's
shared prefix leaves at least one token of either prompt to run; sharing is only
worth it past `min_shared` tokens the cache does not already hold.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from mlx_cache_server.prompt_cache.radix import common_prefix_length


class Admissible(Protocol):
    tokens: list[int]
    cache_key: Any


R = TypeVar("R", bound=Hashable)


@dataclass
class Plan(Generic[R]):
    admit: list[R] = field(default_factory=list)  # in arrival order
    leader_of: dict[R, R] = field(default_factory=dict)  # follower -> the request it waits for
    boundary: dict[R, int] = field(default_factory=dict)  # leader admitted now -> where to cut


def plan_admission(
    new: Sequence[R],
    prefilling: Sequence[R],
    cached: Callable[[R], int],
    min_shared: int,
) -> Plan[R]:
    """Decide for `new` requests, given those still `prefilling` and how much of each
    prompt the cache holds (`cached`)."""
    plan: Plan[R] = Plan()
    for request in new:
        n_cached = cached(request)
        leader, shared = None, 0
        for candidate in [*prefilling, *plan.admit]:
            if candidate.cache_key != request.cache_key:  # type: ignore[attr-defined]
                continue  # another tenant's prefix is not to be shared
            a, b = request.tokens, candidate.tokens  # type: ignore[attr-defined]
            n = min(common_prefix_length(a, b), len(a) - 1, len(b) - 1)
            if n - n_cached >= min_shared and n > shared:
                leader, shared = candidate, n
        if leader is None:
            plan.admit.append(request)
            continue
        plan.leader_of[request] = leader
        if leader in plan.admit:  # not running yet: cut its prompt where the sharing ends
            plan.boundary[leader] = min(plan.boundary.get(leader, shared), shared)
    return plan
