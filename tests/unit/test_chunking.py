"""The prefill chunk policy, against made-up step costs."""

from __future__ import annotations

from app.engine.chunking import StepCosts, chunk_size


def test_nobody_decoding_gets_the_largest_chunk():
    costs = StepCosts(decode=0.1, per_token=0.01)
    assert chunk_size(costs, decoding=False, target_gap=0.8, min_chunk=32, max_chunk=512) == 512


def test_while_streams_decode_a_step_fits_the_gap():
    costs = StepCosts(decode=0.2, per_token=0.005)  # 0.6 s left: 120 tokens
    assert chunk_size(costs, decoding=True, target_gap=0.8, min_chunk=32, max_chunk=512) == 120
    cheap = StepCosts(decode=0.01, per_token=0.0001)
    assert chunk_size(cheap, decoding=True, target_gap=0.8, min_chunk=32, max_chunk=512) == 512


def test_a_prompt_always_progresses_and_starts_small_before_anything_is_measured():
    slow = StepCosts(decode=0.9, per_token=0.01)  # decoding alone takes the whole gap
    assert chunk_size(slow, decoding=True, target_gap=0.8, min_chunk=32, max_chunk=512) == 32
    assert chunk_size(StepCosts(), True, target_gap=0.8, min_chunk=32, max_chunk=512) == 32


def test_costs_follow_the_latest_steps():
    costs = StepCosts()
    costs.saw_prefill(1.0, 100)
    assert costs.per_token == 0.01
    for _ in range(30):  # the prompt grew: attention makes each token dearer
        costs.saw_prefill(2.0, 100)
    assert abs(costs.per_token - 0.02) < 1e-4
    costs.saw_prefill(5.0, 0)  # a step that prefilled nothing says nothing
    assert abs(costs.per_token - 0.02) < 1e-4
    costs.saw_decode(0.1)
    assert costs.decode == 0.1


def test_a_cost_that_just_rose_counts_at_once():
    costs = StepCosts()
    for _ in range(20):
        costs.saw_prefill(0.5, 100)  # 5 ms a token
        costs.saw_decode(0.1)
    assert chunk_size(costs, decoding=True, target_gap=0.8, min_chunk=32, max_chunk=512) == 140
    costs.saw_prefill(1.0, 100)  # the prompt grew: 10 ms a token now
    costs.saw_decode(0.2)
    assert chunk_size(costs, decoding=True, target_gap=0.8, min_chunk=32, max_chunk=512) == 60
