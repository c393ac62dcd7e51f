"""What bounds a request's preparation (issue 55): every rendered byte counted before
templating, grammars' costly parts refused before compiling, a grammar that fails
mid-reply a 400, and preparation on bounded pools with a time budget."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlx_cache_server.engine.events import Failed, GrammarFailed, sampling_failed
from mlx_cache_server.serving.api_errors import APIError
from mlx_cache_server.serving.chat import check_request_chars
from mlx_cache_server.serving.generation import failure_status
from mlx_cache_server.serving.limits import text_chars
from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
from mlx_cache_server.serving.schema_bounds import check_schema
from mlx_cache_server.serving.schema_costs import (
    MAX_LITERAL_CHARS,
    MAX_OPTIONAL_PROPERTIES,
    MAX_REPEAT,
    pattern_problem,
)
from mlx_cache_server.serving.workers import Pool

BIG = "x" * 100_000


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_text_chars_counts_every_string_keys_included_at_any_depth():
    deep: dict = {"k": "abc"}
    for _ in range(5_000):  # past Python's recursion limit
        deep = {"k": deep}
    assert text_chars(deep) == 5_001 * (2 + 1 + 1) + 3  # braces, a separator, the key
    # A number as its digits, True as its name, None as null, a list its brackets and
    # separators: what JSON (or a template's tojson) writes at least.
    assert text_chars([1234, None, True, "ab"]) == 2 + 4 + 4 + 4 + 4 + 2
    assert text_chars([[]] * 1_000) == 2 + 1_000 + 2 * 1_000


def test_text_chars_stops_once_past_its_bound():
    # The list's own brackets and separators, and none of its 6,000,000 characters.
    assert text_chars(["x" * 60] * 100_000, stop_after=100) == 2 + 100_000


class Engine:
    """What the size check reads of an engine: a context of 1,000 tokens of at most 10
    characters, so at most 20,000 characters."""

    context_length, max_token_chars = 1_000, 10


def size_error(req: ChatCompletionRequest) -> APIError | None:
    try:
        check_request_chars(req, Engine())
    except APIError as e:
        return e
    return None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "description": BIG}}]},
         "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "description": BIG}}}}}]},
         "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {f"p{i}": {} for i in range(20_000)}}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "x": [[]] * 50_000}}}]}, "tools"),  # nothing but brackets
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "x": [None] * 50_000}}}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": BIG}}]}]},
         "messages"),
        ({"messages": [{"role": "assistant", "content": "", "reasoning_content": BIG}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]},
         "messages"),
    ],
    ids=["description", "schema", "property names", "empty lists", "nulls", "tool_calls",
         "reasoning", "parts"],
)  # fmt: skip
def test_text_a_template_renders_counts_toward_the_prompt_size(fields, param):
    error = size_error(chat(**fields))
    assert error is not None and error.status == 400, fields
    assert error.code == "context_length_exceeded" and error.param == param


def test_a_request_within_the_bound_passes():
    assert size_error(chat()) is None
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 15_000}}]
    assert size_error(chat(tools=tools)) is None


@pytest.mark.parametrize(
    "schema",
    [
        {"const": "x" * (MAX_LITERAL_CHARS + 1)},
        {"enum": ["a", "x" * (MAX_LITERAL_CHARS + 1)]},
        {"anyOf": [{"const": "x" * 9_000} for _ in range(12)]},
        {"type": "string", "pattern": "a{1000000}"},
        {"type": "string", "pattern": "(a{1000}){1000}"},
        {"type": "object", "patternProperties": {"^(ab{200}){200}$": {}}},
        {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_OPTIONAL_PROPERTIES + 1)}},
        {"anyOf": [{"type": "object", "properties": {f"p{i}": {} for i in range(130)}}] * 2},
        {"anyOf": [{"anyOf": [{"properties": {f"p{i}": {} for i in range(65)}}] * 2}] * 2},
        {"type": "string", "pattern": "(?x) ^ a{ 1000000 } $"},
        {"$defs": {"big": {"const": "y" * (MAX_LITERAL_CHARS + 1)}}, "$ref": "#/$defs/big"},
    ],
    ids=[
        "const",
        "enum",
        "total",
        "count",
        "nested counts",
        "pattern key",
        "optional",
        "union",
        "nested unions",
        "spaced count",
        "ref",
    ],  # fmt: skip
)
def test_what_makes_each_mask_costly_is_refused_before_compiling(schema):
    with pytest.raises(APIError) as refused:
        check_schema(schema, "response_format")
    assert refused.value.status == 400 and refused.value.code == "schema_too_large"


@pytest.mark.parametrize(
    "schema",
    [
        {"const": "x" * (MAX_LITERAL_CHARS - 2)},  # as JSON, with its quotes
        {"type": "string", "pattern": "^(a{100}){100}$"},
        {"type": "string", "pattern": r"^\{999999\}[{]{3}$"},  # braces as characters
        {"type": "string", "pattern": "^a{5,}b*$"},
        {"type": "object", "properties": {f"p{i}": {} for i in range(2_000)},
         "required": [f"p{i}" for i in range(2_000)]},  # required ones cost no branching
    ],
)  # fmt: skip
def test_what_stays_within_the_bounds_is_let_through(schema):
    check_schema(schema, "response_format")


def test_pattern_repeats_multiply_through_groups_only():
    assert pattern_problem(f"a{{{MAX_REPEAT}}}") is None
    assert pattern_problem(f"(a{{{MAX_REPEAT}}})b{{2}}") is None
    assert "repeats" in pattern_problem(f"(a{{{MAX_REPEAT}}}){{2}}")
    assert "repeats" in pattern_problem("a{" + "9" * 5_000 + "}")  # no int() of 5,000 digits


def test_a_grammar_failing_mid_reply_is_the_clients_400_other_faults_a_500():
    failed = sampling_failed(GrammarFailed("too many expressions constructed"))
    assert failed.reason == "grammar" and "too many expressions" in failed.message
    assert failure_status(failed) == (400, "invalid_request_error")
    other = sampling_failed(RuntimeError("boom"))
    assert failure_status(other)[0] == 500 and "boom" not in other.message
    assert failure_status(Failed("x", "timeout"))[0] == 408


def test_a_pool_runs_past_a_busy_thread_up_to_its_bound_and_budget():
    """One thread, held: work queued behind it past its budget is a 503 and never runs;
    the held work, past its budget, is a 400; the pool serves again once it is free."""
    pool = Pool("test", workers=1, budget=0.5, what="testing")
    held, ran = threading.Event(), []

    def hold() -> str:
        held.wait(30)
        return "held"

    async def scenario():
        first = asyncio.ensure_future(pool.run(hold, param="tools"))
        await asyncio.sleep(0.05)  # the first is running
        second = asyncio.ensure_future(pool.run(ran.append, 1))
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        held.set()
        return outcomes, await pool.run(str.upper, "free")

    (first, second), after = asyncio.run(scenario())
    assert isinstance(first, APIError) and first.status == 400 and first.param == "tools"
    assert isinstance(second, APIError) and second.status == 503
    assert after == "FREE" and ran == []  # the queued one was dropped, not run late
