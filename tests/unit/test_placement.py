"""Which decode batch a sequence joins: the main one unless it would be mostly padding."""

from __future__ import annotations

import pytest

from mlx_cache_server.engine.placement import MAIN, PADDING_LIMIT, SIDE, padded, place

ROOM = 16  # sequences the two batches may decode together


def test_padding_is_every_sequence_at_the_longest_per_real_token():
    assert padded([100, 100, 100, 100], 2000) == 5 * 2000 / 2400
    assert padded([], 700) == 1.0  # alone: nothing padded
    assert padded([300, 500], 400) == 3 * 500 / 1200


def test_the_first_sequence_goes_to_the_main_batch():
    assert place(5000, [], [], ROOM) == MAIN


def test_sequences_of_like_lengths_decode_together():
    assert place(350, [300, 280, 410], [], ROOM) == MAIN


def test_a_long_sequence_beside_short_streams_decodes_on_the_side():
    assert padded([100] * 4, 2000) > PADDING_LIMIT
    assert place(2000, [100] * 4, [], ROOM) == SIDE


def test_short_streams_arriving_beside_a_long_one_gather_on_the_side():
    assert place(50, [2000], [], ROOM) == MAIN  # one stream padded to it: still within the limit
    assert place(50, [2000, 60], [], ROOM) == SIDE
    assert place(60, [2000, 60], [50], ROOM) == SIDE  # the side batch, by its own padding


@pytest.mark.parametrize(
    ("length", "main", "side", "where"),
    [
        (300, [10] * 4, [5000, 10], SIDE),  # main 4.4 tokens per real one, side 2.8
        (30, [10] * 4, [5000, 10], MAIN),  # main 2.1, side 3.0
    ],
)
def test_past_the_limit_in_both_the_sequence_pads_the_one_it_pads_less(length, main, side, where):
    assert padded(main, length) > PADDING_LIMIT and padded(side, length) > PADDING_LIMIT
    assert place(length, main, side, ROOM) == where


def test_with_one_batch_empty_sequences_gather_in_the_other():
    assert place(40, [], [60, 50, 45], ROOM) == SIDE  # not a second forward pass for short streams
    assert place(5000, [], [5000], ROOM) == SIDE
    assert place(2000, [], [60, 50, 45], ROOM) == MAIN  # the side batch would be mostly padding
    assert place(40, [60, 50], [], ROOM) == MAIN


def test_past_the_batches_capacity_a_sequence_waits_its_turn_in_the_main_batch():
    assert place(2000, [100] * 4, [], 5) == SIDE
    assert place(2000, [100] * 4, [], 4) == MAIN  # full: it waits there, as with one batch
    assert place(40, [2000], [50, 60], 3) == MAIN
