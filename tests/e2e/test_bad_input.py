"""Bad input gets a 4xx in OpenAI's error shape, and harms nothing."""

from __future__ import annotations

import json

import httpx
import pytest

GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server, body, path="/v1/chat/completions", **kw):
    # json.dumps escapes a lone surrogate as a client's JSON library would ("\ud800").
    content, headers = json.dumps(body), {"content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kw)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


CASES = [
    ("unknown model", {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("empty messages", {**GOOD, "messages": []}, 400, "messages"),
    ("bad role", {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("missing messages", {"model": "tiny"}, 400, "messages"),
    ("wrong type", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature range", {**GOOD, "temperature": 9}, 400, "temperature"),
    ("n > 1", {**GOOD, "n": 2}, 400, "n"),
    ("zero max_tokens", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    (
        "prompt past context",
        {**GOOD, "messages": [{"role": "user", "content": "a" * 5000}]},
        400,
        "messages",
    ),
    ("bad logit_bias", {**GOOD, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("top_logprobs alone", {**GOOD, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "image part",
        {
            **GOOD,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        "messages[0].content[0]",
    ),
    ("stop wrong type", {**GOOD, "stop": 5}, 400, None),
    ("top_k past the vocabulary", {**GOOD, "top_k": 10**9}, 400, "top_k"),
    ("top_k huge", {**GOOD, "top_k": 2**70}, 400, "top_k"),
    ("seed huge", {**GOOD, "seed": 2**70}, 400, "seed"),
    ("seed negative", {**GOOD, "seed": -1}, 400, "seed"),
    ("max_tokens a bool", {**GOOD, "max_tokens": True}, 400, "max_tokens"),
    ("max_tokens a float", {**GOOD, "max_tokens": 5.0}, 400, "max_tokens"),
    ("stream a string", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("temperature a string", {**GOOD, "temperature": "1"}, 400, "temperature"),
    (
        "surrogate in content",
        {**GOOD, "messages": [{"role": "user", "content": "\ud800"}]},
        400,
        None,
    ),
    ("surrogate in model", {**GOOD, "model": "x\udfff"}, 400, None),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_chat_requests(server, name, body, status, param):
    assert_error(post(server, body), status, param)


def test_context_error_names_the_limit(server):
    body = {**GOOD, "messages": [{"role": "user", "content": "a" * 5000}]}
    err = assert_error(post(server, body), 400)
    assert "4096" in err["message"] and err["code"] == "context_length_exceeded"


def test_malformed_json(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400)
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]",
                   headers={"content-type": "application/json"})  # fmt: skip
    assert_error(r, 400)


COMPLETION_CASES = [
    ("empty prompt", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("token out of range", {"model": "tiny", "prompt": [1, 10**6]}, 400, "prompt"),
    ("several prompts", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("unknown model", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("surrogate in prompt", {"model": "tiny", "prompt": "a\ud800b"}, 400, None),
    ("surrogate in a prompt list", {"model": "tiny", "prompt": ["\udc00"]}, 400, None),
    ("echo a string", {"model": "tiny", "prompt": "a", "echo": "true"}, 400, "echo"),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "param"), COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES]
)
def test_bad_completion_requests(server, name, body, status, param):
    assert_error(post(server, body, "/v1/completions"), status, param)


@pytest.mark.parametrize("depth", [300, 950])
@pytest.mark.parametrize(
    "path,field",
    [("/v1/chat/completions", "response_format"), ("/v1/responses", "text"),
     ("/v1/completions", "prompt"), ("/v1/embeddings", "input")],
)  # fmt: skip
def test_a_deeply_nested_body_is_a_400(server, path, field, depth):
    """Nested past Python's recursion limit in what a check walks: once a 500 whose
    traceback alone was larger than a pipe's buffer."""
    body = {"model": "tiny", "messages": GOOD["messages"], "input": "x", "prompt": "x"}
    nest: object = {"type": "text"}
    for _ in range(depth):
        nest = {"a": nest}
    content = json.dumps({**body, field: {"format": nest} if field == "text" else nest})
    r = httpx.post(server.url + path, content=content,
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert_error(r, 400)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    assert_error(httpx.get(server.url + "/v1/models/nope"), 404)


def test_bad_requests_leave_the_cache_and_server_intact(server):
    before = server.engine.cache.stats()
    for _, body, _, _ in CASES:
        post(server, body)
    after = server.engine.cache.stats()
    assert (after.sequences, after.bytes) == (before.sequences, before.bytes)
    r = post(server, GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]


def test_an_unexpected_error_is_a_500_that_says_only_what_the_client_can_use(
    server, monkeypatch, caplog
):
    import mlx_cache_server.serving.chat as chat

    def broken(*args):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(chat, "render_marked", broken)
    r = post(server, GOOD)
    err = assert_error(r, 500)
    assert err["type"] == "server_error" and "secret" not in err["message"]
    assert r.headers["x-request-id"] in err["message"]
    assert "secret internal detail" in caplog.text and r.headers["x-request-id"] in caplog.text
