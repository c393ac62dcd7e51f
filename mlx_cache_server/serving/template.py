"""A chat request through the model's chat template: the prompt's tokens, and where its
messages end among them.

Message ends matter to a hybrid model (`Engine.cache_mode == "checkpointed"`), whose
cache resumes only where it stored a checkpoint: the end of the system prompt is
where a new conversation with the same one (an agent's next session) leaves the last,
and the end of the last message, before the generation prompt, is where the next turn
leaves this one when the template writes a reply back otherwise than it was
generated (without its thinking, say). Each is found as mlx_lm.server finds it: the
messages rendered without what follows them, and what that shares with the prompt.

Past tool calls reach a tool-aware template as it can render them (`call_history`: ids in
its form, calls it would drop written into the content). A template's exception is a 400
only where the client's input is at fault, and says what; `apply_template` says how.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jinja2.exceptions import TemplateError

from mlx_cache_server.prompt_cache.radix import common_prefix_length

from ..engine import Engine
from ..models.vision import Holds
from ..models.vision_load import IMAGE
from . import attribution, call_history, call_markup, harmony, prompted_tools
from .api_errors import APIError
from .images import ImageReader, reader_for
from .openai_bodies import ChatCompletionRequest, ChatMessage
from .tools import ToolPlan, template_tool_calls

log = logging.getLogger("mlx_cache_server")


def template_message(
    m: ChatMessage,
    index: int,
    images: list[Any] | None = None,
    no_images: str = "",
    reader: ImageReader | None = None,
) -> dict[str, Any]:
    """A chat message as chat templates read it. With `images` and `reader` (a vision
    model's request), its image parts are read onto that list and stay parts of its
    content, where the template writes each one's marker; without, an image part is a 400
    saying `no_images`."""
    if isinstance(m.content, list):
        texts, parts = [], []
        for j, part in enumerate(m.content):
            param = f"messages[{index}].content[{j}]"
            if part.type == "image_url" and images is not None and reader is not None:
                url = (part.model_extra or {}).get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(reader.image(url, f"{param}.image_url.url"))
                parts += [{"type": "text", "text": IMAGE}, {"type": "image"}]  # `Vision.tokens`
                continue
            if part.type != "text" or part.text is None:
                message = f"Only text content parts are supported; got a '{part.type}' part."
                if part.type == "image_url":
                    message = f"This model does not take images: {no_images}."
                raise APIError(400, message, param=param)
            texts.append(part.text)
            parts.append({"type": "text", "text": part.text})
        content: Any = parts if len(parts) > len(texts) else "".join(texts)
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
    reader: ImageReader | None = None,
) -> list[int]:
    """The prompt's tokens: the messages (and tools) through the model's chat template,
    with the model's configured template variables (`enable_thinking`, say)."""
    return render_marked(engine, req, tools, strip_attribution, template_kwargs, None, reader)[0]


def render_marked(
    engine: Engine,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    strip_attribution: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    holds: Holds | None = None,
    reader: ImageReader | None = None,
) -> tuple[list[int], tuple[int, ...]]:
    """`render`'s tokens, and for a hybrid model where its messages end among them. The
    images a vision model's prompt registers go on `holds`, which the caller releases when
    the request ends (`ImageIds.release`); without `holds`, they are released here (a
    prompt only counted, never prefilled). `reader` is the one a translated request's
    images were checked with (`to_chat`), which keeps them opened."""
    if holds is None and engine.vision is not None:
        held = Holds(engine.vision.ids)
        try:
            return render_marked(
                engine, req, tools, strip_attribution, template_kwargs, held, reader
            )
        finally:
            held.release()
    reader = reader or reader_for(engine.vision)
    images: list[Any] | None = [] if reader is not None else None
    messages = [
        template_message(m, i, images, engine.no_images, reader) for i, m in enumerate(req.messages)
    ]
    if strip_attribution:
        messages = attribution.strip_attribution(messages)
    if not tools.templated:
        messages = prompted_tools.history(messages, tools.prompted or [])
    else:
        messages = templated_history(engine.tokenizer, messages)
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "add_generation_prompt": True}
    if tools.tools:
        kwargs["tools"] = tools.tools
    # With images, the template's text: their markers are expanded before tokenizing.
    rendered = apply_template(engine.tokenizer, messages, kwargs, tokenize=not images)
    # A forced call in the model's own markup: the prompt is the template's write-back
    # of a call turn, its opening marker already written (`call_markup.prompt_text`).
    written = forced_prompt(engine.tokenizer, messages, kwargs, tools)
    tokenize = None
    if images:
        tokenize = image_tokens(engine, images, holds)
        tokens = tokenize(written if written is not None else rendered + tools.prefix)
    elif written is not None:
        tokens = engine.tokenizer.encode(written, add_special_tokens=False)
    else:
        tokens = rendered + engine.tokenizer.encode(tools.prefix, add_special_tokens=False)
    marks = ()
    if engine.cache is not None and engine.cache_mode == "checkpointed":
        marks = message_ends(engine.tokenizer, messages, kwargs, tokens, tokenize)
    return tokens, marks


def image_tokens(engine: Engine, images: list[Any], holds: Holds) -> Callable[[str], list[int]]:
    """Rendered text to tokens for a vision model: each of the first of `images` that the
    text has markers for at its marker, as its ids (`models.vision`), registered on
    `holds`. The images are prepared once for every text tokenized."""
    prepared = engine.vision.prepare(images)

    def tokenize(text: str) -> list[int]:
        try:
            return engine.vision.tokens(text, prepared[: text.count(IMAGE)], holds)
        except ValueError as e:
            raise APIError(400, f"The images cannot be placed: {e}", param="messages") from e

    return tokenize


def templated_history(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Past calls as a tool-aware template can render them (`call_history`: a Mistral-family
    template's ids and turns that alternate; gpt-oss's harmony: `harmony`)."""
    if harmony.is_harmony(tokenizer):
        return harmony.history(messages)
    if call_history.needs_short_ids(tokenizer):
        messages = call_history.with_short_ids(messages)
        messages = call_history.with_answers_after_results(messages)
    if call_history.drops_calls(tokenizer):
        messages = call_history.with_calls_in_content(messages, tokenizer)
    return messages


def apply_template(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], tokenize: bool = True
) -> Any:
    """The messages through the template, as tokens (or, `tokenize` off, its text: a
    vision model's prompt, whose image markers are expanded first); a 400 only where the
    client's input is at fault.

    A template's own `raise_exception` states a rule of the model's (roles that
    alternate, say): the client broke it, and the 400 says so in the template's words.
    Any other exception is the template failing on input the API allows: it is retried
    as the template can take it (tools it iterates unconditionally, as Hermes 3's does),
    or the client is told which field the template could not use (arguments that are
    no JSON object, for a template that iterates them), or, as a last resort, the
    history is rendered in the server's own tool protocol, and the reason logged."""
    try:
        return _applied(tokenizer, messages, kwargs, tokenize)
    except TemplateError as e:
        if type(e) is TemplateError:  # raise_exception: the template's own rule
            raise APIError(
                400, f"The chat template rejected the messages: {e}", param="messages"
            ) from e
        error: Exception = e
    except Exception as e:
        error = e
    if "tools" not in kwargs:
        try:
            tokens = _applied(tokenizer, messages, {**kwargs, "tools": []}, tokenize)
        except Exception:
            pass
        else:
            log.info(
                "The chat template failed without tools (%s: %s); rendered with an empty "
                "tool list instead.", type(error).__name__, error,
            )  # fmt: skip
            kwargs["tools"] = []  # for `message_ends`, which renders the same way
            return tokens
    bad = _non_object_arguments(messages)
    if bad is not None:
        raise APIError(
            400,
            "This model's chat template needs tool call arguments as a JSON object; "
            f"got {bad[1]!r}.",
            param=bad[0],
        ) from error
    log.warning(
        "The chat template failed on valid messages (%s: %s); rendering their tool calls "
        "in the server's own protocol instead.", type(error).__name__, error,
    )  # fmt: skip
    plain = prompted_tools.history(messages, [])
    try:
        return _applied(tokenizer, plain, kwargs, tokenize)
    except Exception as e:
        raise APIError(
            400, f"This model's chat template cannot render these messages: {e}",
            param="messages",
        ) from e  # fmt: skip


def _applied(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], tokenize: bool
) -> list[int] | str:
    """The messages through the template: its tokens, or (`tokenize` off) its text."""
    out = tokenizer.apply_chat_template(messages, **kwargs, tokenize=tokenize)
    return list(out) if tokenize else out


def _non_object_arguments(messages: list[dict[str, Any]]) -> tuple[str, Any] | None:
    """The first call whose arguments are no object, as (its field, its arguments)."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or []):
            arguments = (call.get("function") or {}).get("arguments")
            if not isinstance(arguments, dict):
                return f"messages[{i}].tool_calls[{j}].function.arguments", arguments
    return None


def forced_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], tools: ToolPlan
) -> str | None:
    """A forced call's prompt text where its format has one, else None."""
    if tools.form is None or not tools.tools:
        return None

    def text(head: list[dict[str, Any]], generation_prompt: bool) -> str:
        opts = {**kwargs, "add_generation_prompt": generation_prompt, "tokenize": False}
        return tokenizer.apply_chat_template(head, **opts)

    return call_markup.prompt_text(text, messages, tools.tools, tools.form)


def message_ends(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
    tokens: list[int],
    tokenize: Callable[[str], list[int]] | None = None,
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
            if tokenize is None:
                rendered = tokenizer.apply_chat_template(head, **plain)
            else:  # a prompt with images: rendered as its text, its images placed
                rendered = tokenize(tokenizer.apply_chat_template(head, **plain, tokenize=False))
        except Exception:  # a template that refuses this shape: no mark, no harm
            continue
        n = common_prefix_length(list(rendered), tokens)
        if 0 < n < len(tokens):
            out.append(n)
    return tuple(sorted(set(out)))
