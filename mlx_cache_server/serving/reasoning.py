"""A reasoning model's thinking, split from its answer: `reasoning_content`, as vLLM does it.

Models that think (Qwen3, DeepSeek-R1 distills, ...) write `<think>...</think>` before
the answer; some chat templates open the block in the generation prompt already, so
the reply starts inside it. mlx-lm knows a model's tags (`TokenizerWrapper.think_start`
and `think_end`). The text inside goes to `reasoning_content`, never to `content`.

The newlines templates put around the thinking are cut (the reasoning's leading and
trailing ones, the answer's leading ones), so that a template that writes a message's
`reasoning_content` back (Qwen3's: "<think>\\n" + reasoning + "\\n</think>\\n\\n" +
content) renders the tokens that were generated, and the next turn reuses them.

`ReasoningSplit` works on a stream: a tag cut between two pieces is held back until
it is whole, as are newlines that may turn out to end the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ThinkTags:
    start: str
    end: str


def think_tags(tokenizer: Any) -> ThinkTags | None:
    """The model's thinking tags, or None for a model that does not think."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    return ThinkTags(tokenizer.think_start, tokenizer.think_end)


def opens_thinking(prompt: str, tags: ThinkTags) -> bool:
    """Whether the prompt's generation prompt opens a thinking block: the prompt ends in
    the tag. (A tag a message mentions, earlier, opens nothing.)"""
    return prompt.rstrip().endswith(tags.start)


class ReasoningSplit:
    """Reply text in, (reasoning, content) pieces out.

    States: "before" (nothing but whitespace yet: the reply may still open a thinking
    block), "thinking", "answer". Text before any tag is an answer, kept as it came.
    """

    def __init__(self, tags: ThinkTags, thinking: bool = False) -> None:
        self.tags = tags
        self.state = "thinking" if thinking else "before"
        self.thought = thinking  # a thinking block was opened
        self.held = ""  # what may be the start of a tag, or trailing newlines
        self.fresh = thinking  # the part just opened has had no text yet: cut its newlines

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        text, self.held = self.held + text, ""
        while text:
            if self.state == "answer":
                content.append(self._cut_leading(text))
                break
            tag = self.tags.start if self.state == "before" else self.tags.end
            at = text.find(tag)
            if at < 0:
                keep = _partial_suffix(text, tag)
                body, partial = text[: len(text) - keep], text[len(text) - keep :]
                if self.state == "before":
                    if body.strip():  # text before any thinking: an answer, as it came
                        self.state = "answer"
                        content.append(body + partial)
                    else:
                        self.held = text
                    break
                kept = body.rstrip("\n")  # newlines that may end the reasoning wait
                self.held = body[len(kept) :] + partial
                reasoning.append(self._cut_leading(kept))
                break
            before, text = text[:at], text[at + len(tag) :]
            if self.state == "before":
                if before.strip():  # an answer that mentions the tag: not thinking
                    self.state = "answer"
                    content.append(before + tag)
                    continue
                self.state, self.thought, self.fresh = "thinking", True, True
            else:
                reasoning.append(self._cut_leading(before.rstrip("\n")))
                self.state, self.fresh = "answer", True
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the reply's end."""
        held, self.held = self.held, ""
        if self.state == "thinking":  # never closed: all of it was thinking
            return self._cut_leading(held.rstrip("\n")), ""
        return "", (held if held.strip() else "")

    def _cut_leading(self, text: str) -> str:
        if self.fresh:
            text = text.lstrip("\n")
            self.fresh = not text
        return text


def split_whole(text: str, tags: ThinkTags, thinking: bool) -> tuple[str | None, str]:
    """A whole reply's reasoning (None when it had no thinking) and content."""
    split = ReasoningSplit(tags, thinking)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.finish()
    return (reasoning + more_reasoning if split.thought else None), content + more_content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
