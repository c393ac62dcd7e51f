"""Claude Code's attribution line, cut from system prompts unless the operator keeps it.

Claude Code (2.1.36 on) starts its system prompt with a text block
`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=XXXXX;` whose
`cch` changes with every request (from 2.1.181, with every conversation when the
base URL is not Anthropic's). At the very start of the prompt, it leaves a prefix
cache nothing to reuse: every turn is prefilled whole, and no two sessions share
their system prompt and tool definitions. Anthropic reads the line as billing
data; a model has no use for it. So it is removed from the start of system messages
before the chat template sees them (and nothing else: a prompt that quotes it
further on keeps it); `--keep-attribution-header` keeps it. The client's own
switch is `CLAUDE_CODE_ATTRIBUTION_HEADER=0`.
"""

from __future__ import annotations

import re
from typing import Any

# The line at the very start of a system message, as Claude Code writes it (fields ending
# in ";"), and the blank lines that joined it to the next text block. Nothing past its last
# ";" is taken: a client that glued the next block to it keeps that block whole.
LINE = re.compile(r"\A\s*x-anthropic-billing-header:(?:\s*[a-z_]+=[^;\n]*;)+[ \t]*(?:\r?\n)*")


def strip_attribution(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the attribution line cut from the start of system messages; a
    system message that held nothing else is left out, as if never sent."""
    out = []
    for message in messages:
        content = message.get("content")
        if message.get("role") == "system" and isinstance(content, str) and LINE.search(content):
            content = LINE.sub("", content)
            if not content.strip():
                continue
            message = {**message, "content": content}
        out.append(message)
    return out
