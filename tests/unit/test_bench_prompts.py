"""The workloads that time decoding ask each prompt once of a server: a prompt asked again
is drafted from the reply it got before (engine/drafting.py looks in recent replies), so
its tokens/s would be a retry's, not the workload's. No server runs."""

from __future__ import annotations

import sys
import types

import pytest


def test_speculation_asks_each_prompt_once_over_its_rounds(bench_script, monkeypatch):
    said = [[f"ShareGPT question {i}"] for i in range(100)]
    fake = types.SimpleNamespace(conversations=lambda n, turns, words: said[:n])
    monkeypatch.setitem(sys.modules, "sharegpt", fake)
    speculation = bench_script("speculation")
    rounds = speculation.rounds_of(4, sharegpt=8)
    prompts = [speculation.QUESTIONS[0]]  # the warm-up
    for r in rounds:
        assert (len(r.edit_1), len(r.edit_4), len(r.edit_8), len(r.chats)) == (4, 4, 8, 4)
        assert len(r.mixed) == 4 and "Here is a file" in r.mixed[0][0]["content"]
        for prompt in [*r.edit_1, *r.edit_4, *r.edit_8, *r.chats, *r.mixed, *r.shared]:
            prompts.append(prompt[0]["content"])
    assert len(prompts) == len(set(prompts)) == 1 + 4 * (17 + 3 + 4 + 8)
    with pytest.raises(SystemExit, match="twice"):
        speculation.rounds_of(5, sharegpt=0)


def test_structured_and_mixed_ask_each_question_once(bench_script):
    mixed, structured = bench_script("mixed"), bench_script("structured")

    asked = structured.asked(6)
    assert len({city for city, _ in asked}) == 12
    assert [c for _, c in asked[:4]] == [False, True, True, False]  # each first by turns
    with pytest.raises(SystemExit, match="twice"):
        structured.asked(9)
    stories = [text for r in range(3) for text in mixed.stories(r, streams=4)]
    assert len({text.split(": ", 1)[1] for text in stories}) == 12  # the subjects too
