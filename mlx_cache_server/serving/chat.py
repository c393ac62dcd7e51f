"""Chat completions: OpenAI's chat messages in, the engine's events out as chat chunks."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ..engine import Candidate, Delta, Engine, Event, TokenLogprob
from ..engine.constraint import GrammarProcessor, build_constraint
from .api_errors import APIError
from .generation import (
    RequestContext,
    Surface,
    collect,
    compiling,
    new_id,
    now,
    off_loop,
    tracked,
    until_disconnected,
)
from .harmony import HarmonySplit, is_harmony
from .images import ImageReader, held_until
from .limits import (
    check_model,
    check_prompt_chars,
    prompt_char_bound,
    reserve_slot,
    sampling_params,
    text_chars,
)
from .openai_bodies import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    FunctionCallDelta,
    ResponseMessage,
    TokenLogprobOut,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from .reasoning import ReasoningSplit, opens_thinking, split_whole, think_tags
from .sse import EventStream, sse_stream
from .structured import response_format_grammar
from .template import render_marked
from .tools import (
    ToolCallText,
    ToolPlan,
    compiles_grammar,
    cut_off_call,
    forced_call,
    plan_tools,
    tool_call,
)

ROUTE = "/v1/chat/completions"


class ChatCompletionsServing(Surface):
    async def create(
        self, req: ChatCompletionRequest, request: Request, tenant: str | None
    ) -> ChatCompletion | EventStream:
        run = await self.start(req, tenant)
        if req.stream:
            logprobs = run.logprobs is not None
            return EventStream(_stream(run.events, run.id, run.created, req, logprobs, run.reply))
        result = await until_disconnected(request, collect(run.events))
        reasoning, content, calls = run.reply.whole_all(result.text)
        return ChatCompletion(
            id=run.id,
            created=run.created,
            model=req.model,
            choices=[
                ChatChoice(
                    index=0,
                    message=ResponseMessage(
                        content=content, reasoning_content=reasoning, tool_calls=calls or None
                    ),
                    logprobs=_logprobs_out(result.logprobs) if run.logprobs is not None else None,
                    finish_reason=_finish_reason(result.finish_reason, calls),
                )
            ],
            usage=result.usage(),
        )

    async def start(
        self,
        req: ChatCompletionRequest,
        tenant: str | None,
        route: str = ROUTE,
        images: ImageReader | None = None,
    ) -> Run:
        """Check a chat request, render it, and start its generation: what the chat surfaces
        share (Messages and Responses translate theirs and start it here, with the reader
        that checked their images, `images`)."""
        engine, settings = self.engine, self.settings
        check_model(req.model, engine, self.aliases)
        if len(req.messages) > settings.max_messages:
            raise APIError(
                400,
                f"Too many messages: {len(req.messages)}; this server accepts at most "
                f"{settings.max_messages}.",
                param="messages",
            )
        await off_loop(check_request_chars, req, engine)  # a walk of megabytes, maybe
        want_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true.", param="top_logprobs")
        slot = reserve_slot(engine, settings)
        holds = held_until(slot.on_release, engine.vision)  # a vision model's images
        try:
            # Off the loop, within the request's slot, and on the grammar threads only
            # where there is a grammar to compile: a request without one never waits
            # behind another's costly schema.
            tools = (
                await compiling(plan_tools, req, engine, param="tools")
                if compiles_grammar(req, engine)
                else plan_tools(req, engine)
            )
            grammar = tools.grammar
            if grammar is None and req.response_format is not None:
                grammar = await compiling(
                    response_format_grammar, req.response_format, param="response_format"
                )
            tokens, marks = await off_loop(
                render_marked, engine, req, tools, settings.strip_attribution_header,
                settings.chat_template_kwargs, holds, images,
            )  # fmt: skip
            params = sampling_params(
                req,
                prompt_tokens=len(tokens),
                max_tokens=req.max_completion_tokens or req.max_tokens,
                logprobs=want_logprobs,
                engine=engine,
                settings=settings,
                defaults=self.defaults,
                prompt_param="messages",
            )
            params.checkpoints = marks
            # A grammar that shapes the whole reply; `auto`'s lazy one leaves text free.
            shaped = grammar is not None and not tools.lazy
            if grammar is not None:
                params.constraint = await compiling(_constraint, engine, grammar)
            if shaped:
                params.stop = []  # a stop string would cut what the grammar makes whole
        except BaseException:
            slot.release()
            raise
        cid = new_id("chatcmpl")
        ctx = RequestContext(cid, route, req.model, tenant)
        events = tracked(engine, tokens, params, ctx, settings.request_timeout, self.metrics, slot)
        reply = Reply(engine, req, tools, _thinking(engine, tokens, tools, shaped))
        return Run(cid, now(), events, reply, want_logprobs, len(tokens))


@dataclass
class Run:
    """A chat request's generation, started: what a surface needs to answer it."""

    id: str
    created: int
    events: AsyncIterator[Event]
    reply: Reply
    logprobs: int | None
    prompt_tokens: int


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request another API's request was translated into, or a 400 saying what of
    it chat's rules refuse (the other API's own validation let it through)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"Invalid request: {where}: {first.get('msg')}.") from e


def _thinking(
    engine: Engine, tokens: list[int], tools: ToolPlan, shaped: bool
) -> ReasoningSplit | None:
    """A splitter for a reasoning model's thinking; None where there can be none (a model
    without thinking tags, or a reply a grammar shapes)."""
    tags = think_tags(engine.tokenizer)
    if tags is None or shaped or tools.mode == "forced":
        return None
    # The generation prompt is the end of the prompt: a block it opens ends it.
    return ReasoningSplit(tags, opens_thinking(engine.tokenizer.decode(tokens[-32:]), tags))


def _constraint(engine: Engine, grammar: str) -> GrammarProcessor:
    try:
        return build_constraint(engine.grammars, grammar)
    except ValueError as e:
        raise APIError(400, f"Cannot constrain this model's output: {e}", code="constraint") from e


class Reply:
    """A reply's text split into content and tool calls, as the request's tools ask.

    Streaming, a forced call goes out as OpenAI's deltas do: its id and name as soon
    as the name is generated, then its arguments as they come; one in a model's own
    markup other than JSON (`call_markup`) goes out whole when it is. A harmony reply
    (gpt-oss) is split by `HarmonySplit` alone: its channels say what each part is.
    """

    def __init__(
        self,
        engine: Engine,
        req: ChatCompletionRequest,
        tools: ToolPlan,
        thinking: ReasoningSplit | None = None,
    ) -> None:
        self.thinking = thinking  # splits a reasoning model's thinking off first
        self.mode = tools.mode
        # Markup is cut out whenever the template was shown tools; with tool_choice "none"
        # the calls it holds are dropped.
        shown = tools.mode == "auto" or (
            tools.mode == "none" and bool(tools.tools or tools.prompted)
        )
        prompted = tools.prompted is not None
        self.text = ToolCallText(engine, req.tools or [], prompted) if shown else None
        self.keep = tools.mode == "auto"
        self.read = tools.read  # a forced call in markup other than JSON: read when whole
        self.names = tools.names  # the tools a forced call may be of
        self.forced = ""  # a forced call's JSON so far: {"name":"...","arguments":{...}}
        self.call: ToolCall | None = None  # the forced call, once its name is known
        self.sent = 0  # how much of `forced` has gone out as argument fragments
        self.calls = 0  # calls sent
        self.harmony = None
        if is_harmony(engine.tokenizer):
            new_call = partial(tool_call, arguments="")
            self.harmony = HarmonySplit(new_call, keep_calls=tools.mode != "none")
            self.text = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content and calls a piece of the reply adds; a reasoning model's thinking is
        left out (never content)."""
        return self.feed_all(text)[1:]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Content and calls held back until the reply's end."""
        return self.finish_all()[1:]

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content and calls of a whole reply (not streamed)."""
        return self.whole_all(text)[1:]

    def feed_all(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        """`feed`, with the reasoning the piece adds first."""
        if self.harmony is not None:
            return self._counted(self.harmony.feed(text))
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
        return (reasoning, *self._feed_answer(text))

    def finish_all(self) -> tuple[str, str, list[ToolCallDelta]]:
        if self.harmony is not None:
            return self._counted(self.harmony.finish())
        reasoning, content, calls = "", "", []
        if self.thinking is not None:
            reasoning, tail = self.thinking.finish()
            content, calls = self._feed_answer(tail)
        more, more_calls = self._finish_answer()
        return reasoning, content + more, calls + more_calls

    def whole_all(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """`whole`, with the reasoning first (None: the reply had no thinking)."""
        if self.harmony is not None:
            return self.harmony.whole(text, keep_cut=self.mode == "forced")
        reasoning = None
        if self.thinking is not None:
            reasoning, text = split_whole(text, self.thinking.tags, self.thinking.thought)
        return (reasoning, *self._whole_answer(text))

    def _counted(self, split: tuple[str, str, list[ToolCallDelta]]) -> tuple:
        self.calls = len(self.harmony.calls)
        return split

    def _feed_answer(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "forced":
            return "", self._forced(text)
        if self.text is None:
            return text, []
        content, calls = self.text.feed(text)
        return content, self._whole(calls if self.keep else [])

    def _finish_answer(self) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "forced" and self.read is not None:
            calls = self.read(self.forced) or [cut_off_call(self.forced, self.names, markup=True)]
            return "", self._whole(calls)
        if self.mode == "forced":
            return "", self._forced("") if forced_call(self.forced) else self._cut_off()
        if self.text is None:
            return "", []
        content, calls = self.text.finish()
        return content, self._whole(calls if self.keep else [])

    def _whole_answer(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "forced":  # one call, whole or cut off (`cut_off_call`)
            calls = self.read(text) if self.read is not None else forced_call(text)
            markup = self.read is not None
            return None, calls or [cut_off_call(text, self.names, markup=markup)]
        if self.text is None:
            return text, []
        content, calls = self.text.feed(text)
        rest, more = self.text.finish()
        content, calls = content + rest, (calls + more if self.keep else [])
        return (None if calls and not content.strip() else content), calls

    def _forced(self, text: str) -> list[ToolCallDelta]:
        self.forced += text
        if self.read is not None:  # markup: the call goes out whole, at the end
            return []
        out = []
        if self.call is None:
            head = _CALL_HEAD.match(self.forced)
            if head is None:
                return out
            self.call, self.sent, self.calls = tool_call(json.loads(head[1]), ""), head.end(), 1
            name = FunctionCallDelta(name=self.call.function.name, arguments="")
            out.append(ToolCallDelta(index=0, id=self.call.id, type="function", function=name))
        stop = len(self.forced) - 1  # the call's own closing brace is not its arguments'
        if stop > self.sent:
            fragment = self.forced[self.sent : stop]
            if out:  # one entry per index in a chunk: clients read tool_calls[0] alone
                out[0].function.arguments = fragment
            else:
                out.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=fragment)))
            self.sent = stop
        return out

    def _cut_off(self) -> list[ToolCallDelta]:
        """A forced call cut off (max_tokens), as far as it came, never as text: the rest of
        its arguments (their last character too, held back as the call's closing brace it
        was not), or, its name not out yet, the whole call now."""
        if self.call is None:
            return self._whole([cut_off_call(self.forced, self.names)])
        rest, self.sent = self.forced[self.sent :], len(self.forced)
        return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=rest))] if rest else []

    def _whole(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out = []
        for call in calls:
            function = FunctionCallDelta(name=call.function.name, arguments=call.function.arguments)
            out.append(
                ToolCallDelta(index=self.calls, id=call.id, type="function", function=function)
            )
            self.calls += 1
        return out


# How a forced call begins: the grammar makes it compact JSON, name first.
_CALL_HEAD = re.compile(r'\{"name": ?("(?:[^"\\]|\\.)*"), ?"arguments": ?(?=[^ ])')


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def check_request_chars(req: ChatCompletionRequest, engine: Engine) -> None:
    """Refuse, before anything is rendered, a chat request whose text cannot fit the
    context: every string of its messages (content, reasoning, tool calls' names and
    arguments, ids) and of its tools (names, descriptions, schemas, their keys too),
    which a template writes at least once each. The error names the larger of the two."""
    bound = prompt_char_bound(engine)
    tools = text_chars(req.tools, stop_after=bound)
    messages = text_chars(req.messages, stop_after=bound - tools)
    check_prompt_chars(tools + messages, engine, "tools" if tools > messages else "messages")


def _logprobs_out(items: list[TokenLogprob]) -> ChoiceLogprobs:
    def entry(c: Candidate) -> TopLogprob:
        return TopLogprob(token=c.text, logprob=c.logprob, bytes=list(c.bytes))

    return ChoiceLogprobs(
        content=[
            TokenLogprobOut(**entry(t).model_dump(), top_logprobs=[entry(c) for c in t.top])
            for t in items
        ]
    )


def _stream(
    events: AsyncIterator[Event],
    cid: str,
    created: int,
    req: ChatCompletionRequest,
    logprobs: bool,
    reply: Reply,
) -> AsyncIterator[str]:
    usage_asked = req.include_usage

    def chunk(choice: ChunkChoice | None, usage: Usage | None = None) -> ChatCompletionChunk:
        out = ChatCompletionChunk(
            id=cid, created=created, model=req.model, choices=[choice] if choice else []
        )
        if usage_asked:
            out.usage = usage  # null on every chunk but the last
        return out

    def parts(content: str, calls: list[ToolCallDelta], lp: Any = None, thought: str = "") -> list:
        out = []
        # Logprobs go with the part their tokens belong to, reasoning or content, as vLLM
        # sends them (a token whose text is held back goes with the part being written).
        thinking = reply.thinking is not None and reply.thinking.state == "thinking"
        if thought or (lp is not None and not content and thinking):
            delta = ChunkDelta(reasoning_content=thought)
            out.append(chunk(ChunkChoice(index=0, delta=delta, logprobs=None if content else lp)))
            lp = lp if content else None
        if content or lp is not None:
            out.append(chunk(ChunkChoice(index=0, delta=ChunkDelta(content=content), logprobs=lp)))
        if calls:
            out.append(chunk(ChunkChoice(index=0, delta=ChunkDelta(tool_calls=calls))))
        return out

    def delta(event: Delta) -> list[ChatCompletionChunk]:
        thought, content, calls = reply.feed_all(event.text)
        lp = _logprobs_out(event.logprobs) if logprobs else None
        return parts(content, calls, lp, thought)

    def finish(reason: str) -> list[ChatCompletionChunk]:
        thought, content, calls = reply.finish_all()
        out = parts(content, calls, thought=thought)
        reason = "tool_calls" if reply.calls and reason == "stop" else reason
        out.append(chunk(ChunkChoice(index=0, delta=ChunkDelta(), finish_reason=reason)))
        return out

    return sse_stream(
        events,
        start=lambda: [chunk(ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content="")))],
        delta=delta,
        finish=finish,
        usage=(lambda usage: chunk(None, usage)) if usage_asked else None,
    )
