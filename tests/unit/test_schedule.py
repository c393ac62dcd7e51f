"""The prefill order (`engine.schedule`): shortest first, short ones beside long ones,
and a bounded wait for long ones. Token counts and a clock stand in for a real engine."""

from __future__ import annotations

from mlx_cache_server.engine.schedule import Waiting, choose, in_line, join_limit

BUDGET = 512
MAX_WAIT = 10.0


def waiting(*remaining: int, arrived: float = 0.0) -> list[Waiting[str]]:
    return [Waiting(f"p{i}", r, arrived + i * 0.001) for i, r in enumerate(remaining)]


def test_with_nothing_prefilling_the_shortest_starts_first():
    assert choose(waiting(3000, 900, 2000), [], BUDGET, now=1.0, max_wait=MAX_WAIT) == ["p1"]


def test_prompts_that_finish_in_one_step_start_together_within_its_budget():
    line = waiting(40, 60, 100, 150, 3000)
    # 4 x 150 > 512: the fourth would not finish in its share of the step.
    assert choose(line, [], BUDGET, now=1.0, max_wait=MAX_WAIT) == ["p0", "p1", "p2"]


def test_a_short_prompt_starts_beside_a_long_prefill_instead_of_waiting_for_it():
    assert choose(waiting(200), [5000], BUDGET, now=1.0, max_wait=MAX_WAIT) == ["p0"]
    # More than its share of one step, but shorter than the prefill: the two share steps.
    assert choose(waiting(1500), [5000], BUDGET, now=1.0, max_wait=MAX_WAIT) == ["p0"]


def test_a_prompt_longer_than_the_one_prefilling_waits_for_it():
    assert choose(waiting(6000), [5000], BUDGET, now=1.0, max_wait=MAX_WAIT) == []
    # Beside two prefills only what finishes within its share of one step starts.
    assert choose(waiting(1500), [5000, 4000], BUDGET, now=1.0, max_wait=MAX_WAIT) == []


def test_a_long_prompt_waits_at_most_max_wait_however_many_short_ones_arrive():
    long = Waiting("long", 8000, arrived=0.0)
    clock = 0.0
    for arrival in range(100):  # a short prompt arrives every second
        clock = float(arrival)
        line = [long, Waiting(f"short{arrival}", 100, arrived=clock)]
        started = choose(line, [], BUDGET, now=clock, max_wait=MAX_WAIT)
        if "long" in started:
            break
        assert started == [f"short{arrival}"]
    assert clock == MAX_WAIT
    assert started[0] == "long"


def test_nothing_starts_beside_a_prefill_while_an_overdue_prompt_waits():
    line = [Waiting("old", 9000, arrived=0.0), Waiting("new", 10, arrived=19.0)]
    assert choose(line, [4000], BUDGET, now=20.0, max_wait=MAX_WAIT) == []
    assert choose(line, [], BUDGET, now=20.0, max_wait=MAX_WAIT)[0] == "old"


def test_overdue_prompts_go_oldest_first_then_shortest_first_ties_by_arrival():
    line = [Waiting("a", 500, 5.0), Waiting("b", 900, 1.0), Waiting("c", 100, 18.0),
            Waiting("d", 100, 17.0)]  # fmt: skip
    assert [w.item for w in in_line(line, now=20.0, max_wait=10.0)] == ["b", "a", "d", "c"]


def test_beside_an_overdue_prompt_only_what_fits_its_share_starts():
    # Overdue prompts head the line by age, not length: a longer one may follow a shorter.
    line = [Waiting("old", 300, 0.0), Waiting("older", 250, 1.0), Waiting("new", 160, 15.0)]
    # Three would share 512 tokens, 170 each: "older" would not finish in its share.
    assert choose(line, [], BUDGET, now=20.0, max_wait=MAX_WAIT) == ["old", "older"]


def test_nothing_waiting_nothing_starts():
    assert choose([], [100], BUDGET, now=0.0, max_wait=MAX_WAIT) == []


def test_prompts_that_cost_more_than_a_steps_fixed_cost_go_one_after_another():
    """Batched, all three get their first token when the last is done; one after another,
    the first two get theirs a prompt or two earlier (a CPU: prefill bound by compute)."""
    line = waiting(32, 32, 32)
    assert choose(line, [], BUDGET, now=1.0, max_wait=MAX_WAIT, join_limit=8) == ["p0"]
    # Cheaper than the step's fixed cost (a GPU): batching them saves more than it delays.
    assert choose(line, [], BUDGET, now=1.0, max_wait=MAX_WAIT, join_limit=64) == [
        "p0", "p1", "p2"
    ]  # fmt: skip
    assert choose(line, [], BUDGET, now=1.0, max_wait=MAX_WAIT) == ["p0", "p1", "p2"]
    # Beside a short prompt that ends in this step, it waits for the next one.
    assert choose(waiting(32), [32], BUDGET, now=1.0, max_wait=MAX_WAIT, join_limit=8) == []


def test_the_join_limit_never_keeps_a_short_prompt_behind_a_long_prefill():
    assert choose(waiting(200), [5000], BUDGET, now=1.0, max_wait=MAX_WAIT, join_limit=8) == [
        "p0"
    ]  # fmt: skip
    line = waiting(3000, 40)  # the long one first (overdue): the short one still joins it
    line[0] = Waiting("p0", 3000, arrived=-20.0)
    assert choose(line, [], BUDGET, now=1.0, max_wait=MAX_WAIT, join_limit=8) == ["p0", "p1"]


def test_the_join_limit_is_a_steps_fixed_cost_in_prompt_tokens():
    assert join_limit(0.070, 0.0083) == 8
    assert join_limit(0.005, 0.00005) == 100
    assert join_limit(None, 0.01) is None and join_limit(0.07, None) is None
