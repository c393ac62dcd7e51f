"""Prompt-lookup drafts and their pace: policy alone, no model."""

from __future__ import annotations

from mlx_cache_server.engine.drafting import (
    ACCEPTED,
    COPYING,
    FORGET,
    MAX_DRAFT,
    PAUSE,
    Pace,
    PromptLookup,
)


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


def test_a_copy_under_way_drafts_as_far_as_its_match_runs():
    """Where the latest tokens stand verbatim earlier for `COPYING` tokens or more (a file
    written back), the pace drafts that far at once, instead of growing from where failed
    drafts (the reply's own words before the copy) left it; not right after a draft that
    failed outright, nor in a pause (repeated text that does not go on the same way)."""
    pace = Pace(k=2)
    assert pace.next_length(COPYING - 1) == 2  # a short match is no copy
    assert pace.next_length(COPYING) == COPYING
    assert pace.next_length(200) == MAX_DRAFT
    pace.saw(MAX_DRAFT, 0)
    assert pace.next_length(200) == pace.k < MAX_DRAFT
    while not pace.paused:
        pace.saw(pace.next_length() or 1, 0)
    assert pace.next_length(200) == 0


def test_a_stream_whose_drafts_failed_drafts_again():
    """Its rate falls with each failed draft and moves only with drafts verified: where the
    batch rule refuses its drafts at that rate, it must recover, or the stream would never
    draft again (an edit whose reply opened with its own words copied the whole file back
    one token a step)."""
    from mlx_cache_server.engine.speculative import draft_length

    pace = Pace(k=1, paused=PAUSE, rate=0.05)  # as many failed drafts leave it
    assert draft_length([MAX_DRAFT], [pace.rate]) == 0
    assert [pace.next_length() for _ in range(PAUSE)] == [0] * PAUSE
    length = pace.next_length()
    assert length > 0 and pace.rate >= ACCEPTED  # a fresh try, as a new stream's
    for rows in (1, 2):  # never paused, its drafts refused: it forgets, slowly
        pace, steps = Pace(k=4, rate=0.05), 0
        while steps < 4 * FORGET and not draft_length(
            [pace.next_length(), *[0] * (rows - 1)], [pace.rate] * rows
        ):
            steps += 1
        assert steps < 2 * FORGET, rows
        assert steps > FORGET // 8 or rows == 1  # alone a pass is cheap: it tries soon


def test_how_far_the_best_match_runs():
    text = list(range(100, 130))
    assert lookup([*text, 7, *text[:12]]).run() == 12
    assert lookup([*text, 7, *text[:12]]).run(most=5) == 5  # as far as the caller reads
    assert lookup([*text, 7, 8]).run() == 0  # the last two never occurred before
    assert lookup([5]).run() == 0
    replies = [lookup([1, 2, *text])]
    seq = PromptLookup(replies)
    seq.extend([9, *text[:20]])
    assert seq.run() == 20  # in a recent reply too


def test_a_step_drafts_as_long_as_its_pass_is_worth_it():
    from mlx_cache_server.engine.speculative import draft_length, longest_draft

    assert draft_length([9]) == 9  # alone, every drafted token is nearly free
    assert draft_length([100]) == longest_draft(1)
    assert draft_length([0]) == draft_length([0, 0]) == 0
    assert draft_length([3, 3, 3, 3]) == 3
    assert draft_length([5, 0]) == 5
    assert draft_length([1, 7]) == 7  # as long as the longer draft, no longer
    # Every stream's speed counts: a stream without a draft waits for the others'
    # positions, so one drafting stream beside three plain ones drafts a few tokens only
    # (which a pass over fillers would not pay for at all), and two a few more.
    assert draft_length([3, 0, 0, 0]) == draft_length([8, 0, 0, 0]) == 3
    # Where a pass computes its fillers, the plain rows' positions cost as much as drafted.
    assert draft_length([8, 0, 0, 0], padded=True) == 0
    assert draft_length([15] * 4, [0.98] * 4, padded=True) == 15
    assert draft_length([15, 15, 0, 0], [0.98, 0.98, 0.75, 0.75]) == 5
    assert draft_length([15, 15, 15, 15], [0.98] * 4) == 15
    assert draft_length([1, 40]) < longest_draft(2)
    # What each stream's drafts have been accepted at decides too: drafts right one time in
    # five pay for a stream alone, not beside three others; drafts that are nearly always
    # wrong pay for none.
    assert draft_length([8], [0.2]) == 8
    assert draft_length([8, 0, 0, 0], [0.2, 0.75, 0.75, 0.75]) == 0
    assert draft_length([8] * 4, [0.05] * 4) == draft_length([8], [0.05]) == 0


def test_the_pace_keeps_the_share_of_its_drafts_accepted():
    pace = Pace()
    for _ in range(20):
        pace.saw(8, 8)
    assert pace.rate > 0.99
    for _ in range(20):
        pace.saw(8, 2)
    assert abs(pace.rate - 0.25) < 0.01


def test_a_recent_reply_drafts_where_the_sequence_has_nothing():
    reply = lookup([50, 51, 9, 8, 7, 6, 5, 4])  # the end of a prompt, then the reply
    seq = PromptLookup([reply])
    seq.extend([1, 2, 3, 50, 51, 9, 8])
    assert seq.draft(3) == [7, 6, 5]
    assert PromptLookup([reply]).draft(3) == []  # nothing yet to match


def test_the_match_that_runs_further_back_drafts_a_reply_winning_a_tie():
    # The prompt holds a file, 10 11 12 13 14; an earlier reply wrote it back with 13
    # renamed 99. Writing it back again, the reply's match runs back to where it began.
    reply = lookup([7, 10, 11, 12, 99, 14])
    seq = PromptLookup([reply])
    seq.extend([10, 11, 12, 13, 14, 7, 10, 11, 12])
    assert seq.draft(2) == [99, 14]
    seq = PromptLookup([lookup([10, 11, 12, 99])])  # as far back as the prompt's: a tie
    seq.extend([10, 11, 12, 13, 7, 10, 11, 12])
    assert seq.draft(1) == [99]
    # A match of the sequence itself that runs further back wins over the reply's.
    seq = PromptLookup([lookup([5, 10, 11, 12, 99, 14])])
    seq.extend([7, 10, 11, 12, 13, 14, 7, 10, 11, 12])
    assert seq.draft(2) == [13, 14]
    # Of two replies matching as far back, the latest (first listed) drafts.
    seq = PromptLookup([lookup([1, 2, 3, 4]), lookup([1, 2, 3, 5])])
    seq.extend([1, 2])
    assert seq.draft(2) == [3, 4]


def test_recent_replies_are_kept_per_key_within_a_budget():
    from mlx_cache_server.engine.replies import ANCHOR, RecentReplies

    replies = RecentReplies(budget=100)
    prompt = list(range(1000, 1000 + 2 * ANCHOR))
    replies.add("a", prompt + [1, 2, 3], len(prompt))
    (kept,) = replies.latest("a")
    assert kept.tokens == prompt[-ANCHOR:] + [1, 2, 3]  # the reply and its prompt's end
    assert replies.latest("b") == [] and replies.tokens == ANCHOR + 3
    replies.add("a", prompt, len(prompt))  # no reply: nothing kept
    replies.add("b", prompt + [1, 2, 3], len(prompt))
    replies.add("a", prompt + [1, 2, 3], len(prompt))  # again: kept once, the latest
    assert replies.tokens == 2 * (ANCHOR + 3)
    replies.add("a", prompt + [4] * 40, len(prompt))  # over the budget: the oldest go
    assert [t.tokens[-1] for t in replies.latest("a")] == [4]
    assert replies.latest("b") == [] and replies.tokens == ANCHOR + 40
    replies.add("a", [9] * 101, 0)  # longer than the whole budget: not kept
    assert replies.tokens == ANCHOR + 40
    replies.clear()
    assert replies.latest("a") == [] and replies.tokens == 0


def test_an_images_positions_are_token_0_to_drafting():
    """A vision model's image ids (past the vocabulary) are never drafted nor handed to a
    draft model, whose embedding would read them out of bounds."""
    from mlx_cache_server.engine.sampling import NON_TEXT

    lookup = PromptLookup()
    lookup.extend([5, 6, NON_TEXT, NON_TEXT + 1, 7, 5, 6])
    assert lookup.tokens == [5, 6, 0, 0, 7, 5, 6]
    assert lookup.draft(2) == [0, 0]
