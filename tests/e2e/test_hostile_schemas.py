"""JSON schemas sent to hurt the server, through every API that takes one, against a
server process of its own: each gets a 4xx (never a 5xx), a stream running beside
them finishes unharmed, and the process is alive at the end. And pydantic's nested
and recursive models as forced tool calls, through all three APIs."""

from __future__ import annotations

import json
import threading
import time
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.live import server_process

ASK = [{"role": "user", "content": "Fill it in."}]


def chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def ref_objects(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a"]} for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def hidden_chain(n: int) -> dict:
    """A $ref chain through a list no schema keyword names: the compiler follows it all."""
    links = [{"$ref": f"#/$defs/x/{i + 1}"} for i in range(n)] + [{"type": "string"}]
    return {"$defs": {"x": links}, "$ref": "#/$defs/x/0"}


def anchor_chain(n: int) -> dict:
    defs = {f"d{i}": {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"$anchor": f"a{n}", "type": "string"}
    return {"$defs": defs, "$ref": "#a0"}


def nested(n: int, wrap) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = wrap(schema)
    return schema


# Each refused with a 400 that names what is wrong (the code a client can act on).
REFUSED = {
    "chain of 1,000 $refs": (chain(1_000), "schema_too_deep"),
    "chain of 10,000 $refs": (chain(10_000), "schema_too_large"),
    "chain of 100,000 $refs": (chain(100_000), "schema_too_large"),
    "1,000 objects by $ref": (ref_objects(1_000), "schema_too_deep"),
    "24,000 $refs through a list": (hidden_chain(24_000), "schema_too_large"),
    "3,000 $refs by anchor": (anchor_chain(3_000), "schema_too_deep"),
    "30,000 true properties": (
        {"type": "object", "properties": {f"p{i}": True for i in range(30_000)}},
        "schema_too_large"),
    "objects nested 200 deep": (
        nested(200, lambda s: {"type": "object", "properties": {"a": s}, "required": ["a"]}),
        "schema_too_deep",
    ),
    "arrays nested 150 deep": (nested(150, lambda s: {"type": "array", "items": s}),
                               "schema_too_deep"),  # fmt: skip
    "anyOf nested 150 deep": (nested(150, lambda s: {"anyOf": [s, {"type": "integer"}]}),
                              "schema_too_deep"),  # fmt: skip
    "a definition that is only itself": (
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "schema_unsatisfiable"),
    "two definitions only each other": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "schema_unsatisfiable"),
    "a required property of its own type": (
        {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        "schema_unsatisfiable"),
    "100,000 enum values": ({"enum": [f"value-{i}" for i in range(100_000)]},
                            "schema_too_large"),  # fmt: skip
    # Issue 55: each compiled, then failed at the reply's second token or made every
    # token's mask cost a batch step's time.
    "a const of 500,000 characters": ({"const": "x" * 500_000}, "schema_too_large"),
    "9,000 optional properties": (
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(9_000)}},
        "schema_too_large"),
    "a pattern a{1000000}": ({"type": "string", "pattern": "^a{1000000}$"}, "schema_too_large"),
    "a pattern (a{1000}){1000}": ({"type": "string", "pattern": "^(a{1000}){1000}$"},
                                  "schema_too_large"),
    "a pattern nested 300 deep": ({"type": "string", "pattern": "(" * 300 + "a" + ")" * 300},
                                  "unsupported_schema"),  # fmt: skip
}  # fmt: skip


def as_tool_parameters(schema: dict) -> dict:
    """`schema` as a tool's one argument, its definitions kept at the root they refer to."""
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    out = {"type": "object", "properties": {"x": inner}, "required": ["x"]}
    return {**out, "$defs": schema["$defs"]} if "$defs" in schema else out


def chat_format(url: str, schema: dict) -> httpx.Response:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "response_format": fmt}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def chat_tool(url: str, schema: dict) -> httpx.Response:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def responses_format(url: str, schema: dict) -> httpx.Response:
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    body = {"model": "tiny", "input": "Fill it in.", "max_output_tokens": 16, "text": text}
    return httpx.post(url + "/v1/responses", json=body, timeout=120)


def responses_tool(url: str, schema: dict) -> httpx.Response:
    tool = {"type": "function", "name": "f", "parameters": schema}
    body = {"model": "tiny", "input": "Fill it in.", "max_output_tokens": 16, "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    return httpx.post(url + "/v1/responses", json=body, timeout=120)


def messages_tool(url: str, schema: dict) -> httpx.Response:
    tool = {"name": "f", "input_schema": schema}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "tools": [tool],
            "tool_choice": {"type": "any"}}  # fmt: skip
    return httpx.post(url + "/v1/messages", json=body, timeout=120)


SURFACES = [chat_format, chat_tool, responses_format, responses_tool, messages_tool]


@pytest.fixture(scope="module")
def own_server(tiny_model_dir, tmp_path_factory):
    with server_process(tiny_model_dir, tmp_path_factory.mktemp("hostile") / "log") as started:
        yield started


class SideStreams:
    """The same greedy stream run back to back until stopped, each chunk's arrival and
    each run's text recorded: unharmed, every run is the text a quiet server gives."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        self.stop, self.gaps, self.texts, self.errors = threading.Event(), [], [], []
        self.reference = self.once()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def once(self) -> str:
        last, text, reasons = time.monotonic(), "", []
        stream = self.client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=300, temperature=0, stream=True
        )
        for chunk in stream:
            now = time.monotonic()
            self.gaps.append(now - last)
            last = now
            text += "".join(c.delta.content or "" for c in chunk.choices)
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert len(reasons) == 1 and reasons[0] in ("stop", "length"), reasons
        return text

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.texts.append(self.once())
            except Exception as e:  # reported by the test
                self.errors.append(repr(e))
                return


def test_hostile_schemas_are_refused_and_hurt_nobody(own_server):
    proc, url = own_server
    side = SideStreams(url)
    side.gaps.clear()
    side.thread.start()
    outcomes = {}
    try:
        for name, (schema, code) in REFUSED.items():
            for surface in SURFACES:
                wrapped = surface in (chat_tool, responses_tool, messages_tool)
                r = surface(url, as_tool_parameters(schema) if wrapped else schema)
                outcomes[(name, surface.__name__)] = (r.status_code, code)
                assert r.status_code == 400, (name, surface.__name__, r.text[:300])
                error = r.json()["error"]
                text = error["message"] if isinstance(error, dict) else str(error)
                assert text, (name, surface.__name__)
                # A tool's schema is rendered into the prompt too: one longer than the tiny
                # model's prompt can hold is refused for that first, before it is compiled.
                codes = {code, "context_length_exceeded"} if wrapped else {code}
                if surface is not messages_tool and surface is not responses_format:
                    assert error.get("code") in codes, (name, surface.__name__, error)
                assert proc.poll() is None, f"the server died on {name} via {surface.__name__}"
    finally:
        side.stop.set()
        side.thread.join(120)
    assert proc.poll() is None
    assert not side.errors, side.errors
    assert side.texts and all(text == side.reference for text in side.texts)
    # A stream never stalled behind a schema being checked or compiled: the bound is far
    # above a decode step of the tiny model, far below what a blocked event loop would show.
    assert max(side.gaps) < 5.0, max(side.gaps)
    assert httpx.get(url + "/health").status_code == 200


class Address(BaseModel):
    street: str = Field(max_length=6)
    city: Literal["Paris", "Rome"]


class Person(BaseModel):
    name: str = Field(max_length=6)
    home: Address
    others: list[Address] = Field(max_length=2)
    work: Address | None = None


class Tree(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no key but these: the tree must end

    v: int = Field(ge=0, le=9)
    kids: list[Tree] = Field(max_length=2)


def test_pydantic_nested_models_as_forced_calls_on_every_api(own_server):
    _, url = own_server
    schema = Person.model_json_schema()
    assert "$defs" in schema  # what the test is about: root-relative pointers
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    chat = oai.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=400, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "save", "parameters": schema}}],
    )  # fmt: skip
    (call,) = chat.choices[0].message.tool_calls
    Person.model_validate_json(call.function.arguments)
    resp = oai.responses.create(
        model="tiny", input="Fill it in.", temperature=0, max_output_tokens=400,
        tools=[{"type": "function", "name": "save", "parameters": schema, "strict": False}],
        tool_choice="required",
    )  # fmt: skip
    (item,) = [o for o in resp.output if o.type == "function_call"]
    Person.model_validate_json(item.arguments)
    ant = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    msg = ant.messages.create(
        model="tiny", messages=ASK, max_tokens=400, extra_body={"temperature": 0},
        tools=[{"name": "save", "input_schema": schema}], tool_choice={"type": "any"},
    )  # fmt: skip
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    Person.model_validate(use.input)


def test_a_recursive_pydantic_model_as_a_forced_call(own_server):
    _, url = own_server
    schema = Tree.model_json_schema()
    assert json.dumps(schema).count('"$ref"') >= 1
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=600, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "grow", "parameters": schema}}],
        logit_bias={"62": 30},  # "]" in the tiny vocabulary: lists close, the tree ends
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    Tree.model_validate_json(call.function.arguments)
