"""The prefill chunk policy, against made-up step costs."""

from __future__ import annotations

import math
import statistics

from mlx_cache_server.engine.chunking import StepCosts, chunk_size

GAP = 0.8


def policy(costs: StepCosts, decoding: bool = True, prompts: int = 1, depth: float = 0) -> int:
    return chunk_size(costs, decoding, GAP, min_chunk=32, max_chunk=512, prompts=prompts,
                      depth=depth)  # fmt: skip


def costs_of(decode: float, *per_token: tuple[float, float]) -> StepCosts:
    """Costs that measured a decode step of `decode` seconds, then prefill steps of 100
    tokens at each (depth, seconds per token), in order."""
    costs = StepCosts()
    costs.saw_decode(decode)
    for depth, seconds in per_token:
        costs.saw_step(seconds * 100, 100, decoded=False, depth=depth)
    return costs


def test_nobody_decoding_gets_the_largest_chunk():
    assert policy(costs_of(0.1, (0, 0.01)), decoding=False) == 512


def test_while_streams_decode_a_step_fits_the_gap():
    assert policy(costs_of(0.23, (0, 0.0047))) == 121  # 0.57 s left: 121 tokens
    cheap = costs_of(0.01)
    cheap.saw_step(512 * 0.0001, 512, decoded=False, depth=256)  # a whole chunk measured
    assert policy(cheap) == 512


def test_prompts_prefilled_together_share_the_step():
    costs = costs_of(0.23, (0, 0.0047))
    assert policy(costs, prompts=4) == 30  # 4 x 30 tokens: the same 0.57 s
    slow = costs_of(0.9, (0, 0.01))  # decoding alone takes the whole gap
    assert policy(slow, prompts=1) == 32 and policy(slow, prompts=4) == 8  # 32 tokens a step


def test_before_any_measurement_the_step_prefills_the_least():
    assert policy(StepCosts()) == 32 and policy(StepCosts(), prompts=3) == 10
    assert policy(costs_of(0.1)) == 32  # a decode step alone says nothing of a prompt token


def test_a_cost_that_just_rose_counts_at_once_a_stall_only_so_much():
    costs = costs_of(0.1, *[(0, 0.005)] * 20)  # 5 ms a token
    assert abs(costs.per_token(0) - 0.005) < 1e-9 and policy(costs) == 140
    costs.saw_step(1.0, 100, decoded=False)  # the host got slower: 10 ms a token now
    assert policy(costs) == 70
    costs.saw_step(60.0, 100, decoded=False)  # a stall: counted as 4x the expected at most
    assert costs.prefill[-1][1] <= 4 * 0.01 + 1e-12


def test_steps_that_prefill_a_few_tokens_are_not_measured():
    costs = StepCosts()
    costs.saw_step(0.3, 4, decoded=True)  # a prompt's last few tokens beside the decode
    assert costs.per_token(0) is None
    costs.saw_step(0.2, 0, decoded=False)  # nothing ran
    assert costs.decode is None


def fake_cost(depth: float) -> float:
    """Seconds per prompt token on a made-up machine: attention reads every token before."""
    return 0.002 + 1e-6 * depth


def test_a_tokens_cost_is_a_line_in_its_depth():
    costs = costs_of(0.08, *[(d, fake_cost(d)) for d in (100, 400, 700, 1000, 1300)])
    base, slope = costs.line()
    assert abs(base - 0.002) < 1e-9 and abs(slope - 1e-6) < 1e-12
    # A prompt starting afresh is not charged the deep tokens' cost it measured last, nor
    # less than the cheapest token measured (the line is not followed below it).
    assert abs(costs.per_token(700) - fake_cost(700)) < 1e-9
    assert abs(costs.per_token(0) - fake_cost(100)) < 1e-9
    assert policy(costs, depth=0) > policy(costs, depth=2000) > 0
    flat = costs_of(0.08, (1300, fake_cost(1300)))  # what an average of the deep end reads
    assert policy(costs, depth=0) > policy(flat, depth=0)


def test_measurements_at_one_depth_give_no_slope_and_a_falling_one_is_read_flat():
    costs = costs_of(0.08, (500, 0.003), (510, 0.004), (520, 0.003))
    assert costs.line()[1] == 0.0
    shallow_stall = costs_of(0.08, (0, 0.009), (1000, 0.003))  # cheaper deeper: noise
    assert shallow_stall.line()[1] == 0.0
    assert shallow_stall.per_token(0) >= 0.003  # never below the cheapest measured


def test_a_long_prefill_beside_decoding_fills_each_step_and_never_overruns_it():
    """A 6,000-token prompt prefilled beside streams that decode in 0.08 s, the chunk each
    step sized from what the steps before measured, on the made-up machine."""
    decode, at, steps = 0.08, 0, []
    costs = costs_of(decode)
    while at < 6000:
        chunk = min(policy(costs, depth=at), 6000 - at)
        prefill = sum(fake_cost(at + i) for i in range(chunk))
        costs.saw_step(decode + prefill, chunk, decoded=True, depth=at + chunk / 2)
        steps.append(decode + prefill)
        at += chunk
    shown = [round(s, 3) for s in steps]
    assert max(steps) <= GAP + 1e-9, shown  # the first steps too: they grow by measured steps
    assert statistics.median(steps) >= 0.97 * GAP, shown
    assert len(steps) <= math.ceil(sum(steps) / GAP) + 4, shown  # a few steps to grow into it


def test_a_step_faster_than_the_decode_average_is_no_measurement():
    costs = costs_of(0.1)
    costs.saw_step(0.09, 32, decoded=True)  # 32 tokens beside a decode that varies: <= 0
    assert not costs.prefill and policy(costs) == 32
    costs.saw_step(0.6, 100, decoded=True)  # a real one still counts
    assert abs(costs.per_token(0) - 0.005) < 1e-9 and policy(costs) == 140


def test_a_decode_average_above_what_a_mixed_step_leaves_of_itself_is_dropped():
    costs = costs_of(0.65)  # a stall as the streams started, and no decode step alone since
    assert policy(costs) == 32
    costs.saw_step(0.25, 32, decoded=True)  # the streams' step was part of this one
    assert costs.decode == costs.last_decode == 0.25  # no token's cost known: all of it
    assert policy(costs) == 32  # nothing of the prompt's cost is known yet, but
    costs.saw_step(0.45, 32, decoded=True)  # the next step measures it
    assert abs(costs.per_token(0) - 0.2 / 32) < 1e-9
    assert policy(costs) == 64  # what fits the gap (88), at most twice the chunk measured
    # Known now: a token costs at least 0.2 / 32 s. A step of 64 tokens in 0.5 s leaves the
    # streams at most 0.1 s of it.
    costs.saw_step(0.5, 64, decoded=True, depth=32)
    assert abs(costs.decode - (0.5 - 64 * 0.2 / 32)) < 1e-9


def test_a_mixed_step_within_the_decode_average_leaves_it():
    costs = costs_of(0.1, (0, 0.002))
    costs.saw_step(0.6, 200, decoded=True, depth=100)  # leaves 0.2, above the average
    assert costs.decode == 0.1


def test_past_the_measured_depths_a_chunk_grows_by_steps():
    costs = costs_of(0.08, (16, 0.0005))  # one small chunk measured, and cheap
    assert policy(costs, depth=32) == 200  # 2 x its 100 tokens, not the 512 it would afford
    # A prompt with a long cached prefix, far deeper than anything measured (short prompts
    # only, so no slope to read): the smallest chunk first, which measures the cost there.
    shallow = costs_of(0.08, *[(d, fake_cost(d)) for d in (100, 110, 120)])
    assert shallow.line()[1] == 0.0
    assert policy(shallow, depth=30_000) == 32
    assert policy(shallow, depth=100) > 32
