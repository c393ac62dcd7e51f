"""Thinking split from the answer (`serving.reasoning`), whole and streamed in pieces."""

from __future__ import annotations

import pytest

from mlx_cache_server.serving.reasoning import (
    ReasoningSplit,
    ThinkTags,
    opens_thinking,
    split_whole,
)

TAGS = ThinkTags("<think>", "</think>")

CASES = [
    # (reply, prompt opened thinking, reasoning, content)
    ("<think>\nI should greet.\n</think>\n\nHello!", False, "I should greet.", "Hello!"),
    ("I should greet.\n</think>\n\nHello!", True, "I should greet.", "Hello!"),
    ("\n<think>\nstep 1\n\nstep 2\n</think>\n\nDone.\n", False, "step 1\n\nstep 2", "Done.\n"),
    ("Hello there.", False, None, "Hello there."),
    ("\nHello there.", False, None, "\nHello there."),
    ("Use <think> tags.", False, None, "Use <think> tags."),
    ("<think>\nstill thinking\n\n", False, "still thinking", ""),
    ("<think></think>Answer", False, "", "Answer"),
    ("x < y and </thinker>", True, "x < y and </thinker>", ""),
]


@pytest.mark.parametrize(("reply", "opened", "reasoning", "content"), CASES)
def test_whole_replies(reply, opened, reasoning, content):
    assert split_whole(reply, TAGS, opened) == (reasoning, content)


@pytest.mark.parametrize(("reply", "opened", "reasoning", "content"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_in_pieces_gives_the_same_split(reply, opened, reasoning, content, size):
    split = ReasoningSplit(TAGS, opened)
    pieces = [split.feed(reply[i : i + size]) for i in range(0, len(reply), size)]
    pieces.append(split.finish())
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content
    # A tag never leaks into either part, even half of one.
    if reasoning is not None:
        assert not any("<th" in r or "</" in c for r, c in pieces)


def test_a_prompt_that_opens_a_thinking_block():
    assert opens_thinking("<|im_start|>assistant\n<think>\n", TAGS)
    assert not opens_thinking("<think>\nx\n</think>\n\nok<|im_start|>assistant\n", TAGS)
    assert not opens_thinking("<|im_start|>assistant\n", TAGS)
    # A message that mentions the tag opens nothing: only the generation prompt can.
    assert not opens_thinking("What is <think>?<|im_end|>\n<|im_start|>assistant\n", TAGS)
