"""The prefill chunk policy, against made-up step costs."""

from __future__ import annotations

from app.engine.chunking import StepCosts, chunk_size


def policy(costs: StepCosts, decoding: bool = True, prompts: int = 1) -> int:
    return chunk_size(costs, decoding, target_gap=0.8, min_chunk=32, max_chunk=512, prompts=prompts)


def test_nobody_decoding_gets_the_largest_chunk():
    assert policy(StepCosts(decode=0.1, per_token=0.01), decoding=False) == 512


def test_while_streams_decode_a_step_fits_the_gap():
    costs = StepCosts(decode=0.23, per_token=0.0047)  # 0.57 s left: 121 tokens
    assert policy(costs) == 121
    assert policy(StepCosts(decode=0.01, per_token=0.0001)) == 512


def test_prompts_prefilled_together_share_the_step():
    costs = StepCosts(decode=0.23, per_token=0.0047)
    assert policy(costs, prompts=4) == 30  # 4 x 30 tokens: the same 0.57 s
    slow = StepCosts(decode=0.9, per_token=0.01)  # decoding alone takes the whole gap
    assert policy(slow, prompts=1) == 32 and policy(slow, prompts=4) == 8  # 32 tokens a step


def test_before_any_measurement_the_step_prefills_the_least():
    assert policy(StepCosts()) == 32 and policy(StepCosts(), prompts=3) == 10


def test_a_cost_that_just_rose_counts_at_once_a_stall_only_so_much():
    costs = StepCosts()
    for _ in range(20):
        costs.saw_step(0.1, 0, decoded=True)  # decode-only steps: 0.1 s
        costs.saw_step(0.6, 100, decoded=True)  # 0.5 s of it prefill: 5 ms a token
    assert abs(costs.per_token - 0.005) < 1e-9 and policy(costs) == 140
    costs.saw_step(1.1, 100, decoded=True)  # the prompt grew: 10 ms a token now
    assert policy(costs) == 70
    costs.saw_step(60.0, 100, decoded=True)  # a stall: counted as 4x the average at most
    assert costs.last_per_token <= 4 * 0.0066


def test_steps_that_prefill_a_few_tokens_are_not_measured():
    costs = StepCosts()
    costs.saw_step(0.3, 4, decoded=True)  # a prompt's last few tokens beside the decode
    assert costs.per_token is None
    costs.saw_step(0.2, 0, decoded=False)  # nothing ran
    assert costs.decode is None
