"""A chat request through the model's chat template: the prompt's tokens, and where its
messages end among them.

Message ends matter to a hybrid model (`Engine.cache_mode == "checkpointed"`), whose
cache resumes only where it stored a checkpoint: the end of the system prompt is
where a new conversation with the same one (an agent's next session) leaves the last,
and the end of the last message, before the generation prompt, is where the next turn
leaves this one when the template writes a reply back otherwise than it was
generated (without its thinking, say). Each is found as mlx_lm.server finds it: the
messages rendered without what follows them, and what that shares with the prompt.
"""

from __future__ import annotations

from typing import Any

from prompt_cache.radix import common_prefix_length

from ..engine import Engine
from . import attribution, harmony, prompted_tools
from .errors import APIError
from .schemas import ChatCompletionRequest, ChatMessage
from .tools import ToolPlan, template_tool_calls


def template_message(m: ChatMessage, index: int) -> dict[str, Any]:
    """A chat message as chat templates read it."""
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"Only text content parts are supported; got a '{part.type}' part.",
                    param=f"messages[{index}].content[{j}]",
                )
            texts.append(part.text)
        content = "".join(texts)
    else:
        content = m.content or ""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = content
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and m.role == "assistant":  # for templates that write it back
        out["reasoning_content"] = reasoning
    if m.tool_calls is not None:
        out["tool_calls"] = template_tool_calls(m.tool_calls)
    return out


def render(
    engine: Engine,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    strip_attribution: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's tokens: the messages (and tools) through the model's chat template,
    with the model's configured template variables (`enable_thinking`, say)."""
    return render_marked(engine, req, tools, strip_attribution, template_kwargs)[0]


def render_marked(
    engine: Engine,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    strip_attribution: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], tuple[int, ...]]:
    """`render`'s tokens, and for a hybrid model where its messages end among them."""
    messages = [template_message(m, i) for i, m in enumerate(req.messages)]
    if strip_attribution:
        messages = attribution.strip_attribution(messages)
    if not tools.templated:
        messages = prompted_tools.history(messages, tools.prompted or [])
    elif harmony.is_harmony(engine.tokenizer):
        messages = harmony.history(messages)
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "add_generation_prompt": True}
    if tools.tools:
        kwargs["tools"] = tools.tools
    try:
        tokens = list(engine.tokenizer.apply_chat_template(messages, **kwargs))
    except Exception as e:  # the model's own template refused these messages
        raise APIError(
            400, f"The chat template rejected the messages: {e}", param="messages"
        ) from e
    # A forced call in the model's own markup: its opening marker is already written.
    tokens += engine.tokenizer.encode(tools.prefix, add_special_tokens=False)
    marks = ()
    if engine.cache is not None and engine.cache_mode == "checkpointed":
        marks = message_ends(engine.tokenizer, messages, kwargs, tokens)
    return tokens, marks


def message_ends(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], tokens: list[int]
) -> tuple[int, ...]:
    """Where the leading system messages and all the messages end in `tokens`, and where
    the generation prompt parts from an assistant turn as the template writes one back
    (before a thinking block it opens, say): each as far as its own rendering agrees
    with `tokens`; those that end nowhere inside them are left out."""
    plain = {**kwargs, "add_generation_prompt": False}
    systems = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    heads = [messages, [*messages, {"role": "assistant", "content": ""}]]
    if 0 < systems < len(messages):  # an empty turn after them, as a template needs one
        heads.insert(0, [*messages[:systems], {"role": "user", "content": ""}])
    out = []
    for head in heads:
        try:
            rendered = tokenizer.apply_chat_template(head, **plain)
        except Exception:  # a template that refuses this shape: no mark, no harm
            continue
        n = common_prefix_length(list(rendered), tokens)
        if 0 < n < len(tokens):
            out.append(n)
    return tuple(sorted(set(out)))
