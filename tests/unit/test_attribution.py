"""Claude Code's attribution line cut from system messages, and nothing else."""

from __future__ import annotations

from app.serving.attribution import strip_attribution

HEADER = "x-anthropic-billing-header: cc_version=2.1.128.bd9; cc_entrypoint=cli; cch=78ef3;"


def test_the_line_and_its_separator_go_the_rest_stays():
    system = {"role": "system", "content": f"{HEADER}\n\nYou are Claude Code.\n\nBe brief."}
    user = {"role": "user", "content": f"{HEADER}\n\nquoted by the user"}
    assert strip_attribution([system, user]) == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        user,  # only system messages are the client's own words about itself
    ]


def test_a_line_in_the_middle_or_alone_is_cut():
    middle = {"role": "system", "content": f"First.\n{HEADER}\nLast."}
    alone = {"role": "system", "content": HEADER}
    assert strip_attribution([alone, middle]) == [{"role": "system", "content": "First.\nLast."}]


def test_a_prompt_without_it_is_untouched():
    messages = [
        {"role": "system", "content": "Mentions x-anthropic-billing-header: mid-line."},
        {"role": "user", "content": "hi"},
    ]
    assert strip_attribution(messages) == messages
