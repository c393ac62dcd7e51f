"""Claude Code's attribution line cut from system messages, and nothing else."""

from __future__ import annotations

from mlx_cache_server.serving.attribution import strip_attribution

HEADER = "x-anthropic-billing-header: cc_version=2.1.128.bd9; cc_entrypoint=cli; cch=78ef3;"


def test_the_line_and_its_separator_go_the_rest_stays():
    system = {"role": "system", "content": f"{HEADER}\n\nYou are Claude Code.\n\nBe brief."}
    user = {"role": "user", "content": f"{HEADER}\n\nquoted by the user"}
    assert strip_attribution([system, user]) == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        user,  # only system messages are the client's own words about itself
    ]


def test_only_the_start_of_a_system_message_and_only_the_line():
    glued = {"role": "system", "content": f"{HEADER}You are Claude Code.\nRule 2."}
    later = {"role": "system", "content": f"Proxy notes:\n{HEADER}\nAlways be brief."}
    alone = {"role": "system", "content": f"  {HEADER}\r\n"}
    assert strip_attribution([alone, glued, later]) == [
        {"role": "system", "content": "You are Claude Code.\nRule 2."},  # parts joined as ""
        later,  # quoted further on: the client's own words
    ]


def test_a_prompt_without_it_is_untouched():
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: is what Claude Code sends."},
        {"role": "system", "content": "Mentions x-anthropic-billing-header: mid-line."},
        {"role": "user", "content": "hi"},
    ]
    assert strip_attribution(messages) == messages
