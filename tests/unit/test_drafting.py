"""Prompt-lookup drafts and their pace: policy alone, no model."""

from __future__ import annotations

from app.engine.drafting import MAX_DRAFT, PAUSE, Pace, PromptLookup


def lookup(tokens: list[int]) -> PromptLookup:
    index = PromptLookup()
    index.extend(tokens)
    return index


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_suffix():
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 1, 2, 3]
    assert lookup(seq).draft(2) == [7, 7]  # the later of the two earlier "1 2 3"
    assert lookup(seq).draft(6) == [7, 7, 5, 1, 2, 3]  # up to the sequence's end...
    assert lookup(seq).draft(8) == [7, 7, 5, 1, 2, 3, 7, 7]  # ...and on as the cycle it is


def test_the_longest_suffix_that_occurred_before_wins():
    # "4 2" occurred twice; "3 4 2" only once, before 8: the longer match decides.
    seq = [3, 4, 2, 8, 0, 4, 2, 6, 0, 3, 4, 2]
    assert lookup(seq).draft(1) == [8]


def test_no_draft_without_an_earlier_occurrence_and_never_the_suffix_itself():
    assert lookup([1, 2, 3, 4]).draft(4) == []
    assert lookup([5]).draft(4) == []
    assert lookup([1, 1]).draft(3) == []  # "1 1" ends the sequence, nothing before it
    assert lookup([1, 1, 1]).draft(3) == [1, 1, 1]  # a run of one token goes on as one


def test_extending_in_pieces_indexes_as_all_at_once():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    pieces = PromptLookup()
    for i in range(0, len(seq), 3):
        pieces.extend(seq[i : i + 3])
    whole = lookup(seq)
    assert pieces.ends == whole.ends and pieces.draft(3) == whole.draft(3) == [4, 1, 2]


def test_the_pace_grows_on_success_shrinks_on_failure_and_pauses():
    pace = Pace()
    first = pace.next_length()
    pace.saw(first, first)
    assert pace.next_length() > first
    for _ in range(10):
        pace.saw(pace.k, pace.k)
    assert pace.next_length() == MAX_DRAFT
    pace.saw(MAX_DRAFT, 3)  # right up to 3: try a little more than that next
    assert pace.next_length() == 4
    for _ in range(3):  # three drafts in a row of nothing: a pause
        pace.saw(pace.next_length() or 1, 0)
    assert [pace.next_length() for _ in range(PAUSE)] == [0] * PAUSE
    assert pace.next_length() > 0


def test_a_step_drafts_as_long_as_its_pass_is_worth_it():
    from app.engine.speculative import draft_length, longest_draft

    assert draft_length([9]) == 9  # alone, every drafted token is nearly free
    assert draft_length([40]) == longest_draft(1)
    assert draft_length([0]) == draft_length([0, 0]) == 0
    assert draft_length([3, 3, 3, 3]) == 3
    assert draft_length([5, 0]) == 5  # one of two streams drafting pays for the other's row
    # One of four does not: the rows of positions it fills but never keeps cost more.
    assert draft_length([3, 0, 0, 0]) == draft_length([8, 0, 0, 0]) == 0
    assert draft_length([3, 3, 0, 0]) == draft_length([3, 3, 3, 0]) == 3
    assert draft_length([1, 7]) == 7  # as long as the longer draft, no longer
    assert draft_length([1, 40]) == longest_draft(2)
