"""Observability and protection: metrics, cache admin, logs, keys, limits, shutdown."""

from __future__ import annotations

import json
import logging
import signal
import stat
import threading

import httpx
import pytest

from tests.helpers import wait_until
from tests.live import serving, start_server

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
NO_END = {"logit_bias": {"99": -100}}  # <|im_end|> of the tiny tokenizer: generate to the limit


def post(url, body=CHAT, key=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60, **kw)


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_cache_stats_and_flush(server):
    post(server.url)
    post(server.url)
    report = httpx.get(server.url + "/v1/cache").json()
    assert report["enabled"] and report["sequences"] >= 1 and report["bytes"] > 0
    (tiny,) = [m for m in report["models"] if m["model"] == "tiny" and m["namespace"] is None]
    assert tiny["lookups"] >= 2 and tiny["tokens_reused"] > 0 and 0 < tiny["reuse"] <= 1
    assert report["max_sequences"] == 64
    assert httpx.delete(server.url + "/v1/cache").json()["cleared"] >= 1
    after = httpx.get(server.url + "/v1/cache").json()
    assert after["sequences"] == 0 and after["bytes"] == 0
    error_of(httpx.delete(server.url + "/v1/cache", params={"model": "nope"}), 404)


def test_metrics_count_requests_tokens_and_cache(server):
    post(server.url)
    post(server.url)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        'mlx_requests_total{route="/v1/chat/completions",status="200"}',
        "mlx_time_to_first_token_seconds_bucket",
        "mlx_request_duration_seconds_count",
        "mlx_prompt_tokens_total",
        "mlx_cached_tokens_total",
        'mlx_cache_bytes{model="tiny",namespace=""}',
        "mlx_cache_sequences",
        "mlx_cache_evictions",
        "mlx_cache_shortened",
        "mlx_cache_reuse_ratio",
        "mlx_queue_depth",
        "mlx_running_requests",
    ):
        assert name in text, name
    cached = [line for line in text.splitlines() if line.startswith("mlx_cached_tokens_total")]
    assert float(cached[0].split()[-1]) > 0


def test_one_structured_log_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="mlx_cache_server.requests"):
        r = post(server.url)
        wait_until(lambda: caplog.records, seconds=5)
    lines = [json.loads(rec.getMessage()) for rec in caplog.records]
    (line,) = [x for x in lines if x["id"] == r.json()["id"]]
    assert line["model"] == "tiny" and line["route"] == "/v1/chat/completions"
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert line["finish_reason"] in ("stop", "length") and line["total_ms"] >= line["ttft_ms"] > 0


def test_a_stream_cut_by_its_client_is_logged_with_the_tokens_it_cost(server, caplog):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 2000, "stream": True, **NO_END}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mlx_cache_server.requests"):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 30:
                    break  # the client leaves mid-stream
        wait_until(lambda: any("disconnected" in rec.getMessage() for rec in caplog.records))
    (line,) = [json.loads(rec.getMessage()) for rec in caplog.records
               if '"disconnected"' in rec.getMessage()]  # fmt: skip
    assert 29 <= line["completion_tokens"] < 2000


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    with serving(
        str(tiny_model_dir), served_model_name="tiny", api_keys=["key-a", "key-b"],
        admin_key="admin", cors_origins=["http://ui.example"],
    ) as live:  # fmt: skip
        yield live


def test_api_keys(keyed):
    assert error_of(post(keyed.url), 401)["code"] == "invalid_api_key"
    error_of(post(keyed.url, key="wrong"), 401)
    assert post(keyed.url, key="key-a").status_code == 200
    assert post(keyed.url, key="key-b").status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # stays open
    error_of(httpx.get(keyed.url + "/v1/models"), 401)
    ok = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer key-a"})
    assert ok.status_code == 200


def test_admin_routes_need_the_admin_key(keyed):
    user = {"Authorization": "Bearer key-a"}
    admin = {"Authorization": "Bearer admin"}
    error_of(httpx.get(keyed.url + "/v1/cache", headers=user), 401)
    error_of(httpx.get(keyed.url + "/metrics", headers=user), 401)
    assert httpx.get(keyed.url + "/v1/cache", headers=admin).status_code == 200
    assert httpx.get(keyed.url + "/metrics", headers=admin).status_code == 200
    error_of(post(keyed.url, key="admin"), 401)  # the admin key is not an API key


def test_docs_and_schema_need_an_api_key_when_the_api_does(keyed, server):
    for path in ("/openapi.json", "/docs"):
        error_of(httpx.get(keyed.url + path), 401)
        ok = httpx.get(keyed.url + path, headers={"Authorization": "Bearer key-a"})
        assert ok.status_code == 200
        assert httpx.get(server.url + path).status_code == 200  # an open server: open docs
    assert "/v1/chat/completions" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_with_api_keys_and_no_admin_key_admin_routes_are_off(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", api_keys=["key-a"]) as live:
        user = {"Authorization": "Bearer key-a"}
        assert post(live.url, key="key-a").status_code == 200
        for method, path in (("GET", "/v1/cache"), ("DELETE", "/v1/cache"), ("GET", "/metrics")):
            r = httpx.request(method, live.url + path, headers=user)
            assert error_of(r, 403)["code"] == "admin_disabled"
        assert live.engine.cache.nbytes > 0  # the tenant could not flush it


def test_cache_report_has_no_budget_when_none_is_set(server):
    assert httpx.get(server.url + "/v1/cache").json()["max_bytes"] is None


def test_a_flush_gives_the_memory_back_at_once(tiny_model_dir):
    import mlx.core as mx

    with serving(str(tiny_model_dir), served_model_name="tiny") as live:
        live.engine.release_after = 3600  # no idle release: only the flush can do it
        assert post(live.url, {**CHAT, "max_tokens": 16}).status_code == 200
        wait_until(lambda: live.engine.running == 0, seconds=10)
        assert live.engine.cache.nbytes > 0
        # The request's freed buffers are pooled; the flush frees the KV too, and only the
        # release it asks for (the idle one is an hour away) empties the pool.
        assert mx.get_cache_memory() > 0
        assert httpx.delete(live.url + "/v1/cache").json()["cleared"] == 1
        wait_until(lambda: mx.get_cache_memory() == 0, seconds=5)


def test_tenants_never_share_cached_prompts(keyed):
    body = {**CHAT, "messages": [{"role": "user", "content": "a secret prompt " * 8}]}
    first = post(keyed.url, body, key="key-a").json()["usage"]["prompt_tokens_details"]
    again = post(keyed.url, body, key="key-a").json()["usage"]["prompt_tokens_details"]
    other = post(keyed.url, body, key="key-b").json()["usage"]["prompt_tokens_details"]
    # Both tenants sent the same requests before this one; only key-a has sent this prompt.
    assert again["cached_tokens"] > first["cached_tokens"]
    assert other["cached_tokens"] == first["cached_tokens"]  # key-b cannot reuse key-a's
    report = httpx.get(keyed.url + "/v1/cache", headers={"Authorization": "Bearer admin"})
    namespaces = {m["namespace"] for m in report.json()["models"]}
    assert len(namespaces) == 2 and None not in namespaces


def test_cors(keyed, server):
    preflight = {
        "Origin": "http://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=preflight)
    assert r.headers["access-control-allow-origin"] == "http://ui.example"
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers  # off unless configured


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    with serving(
        str(tiny_model_dir), served_model_name="tiny", max_body_bytes=2000, max_messages=3,
        max_queue=0, completion_batch_size=1, prefill_batch_size=1,
    ) as live:  # fmt: skip
        yield live


def test_body_size_limit(limited):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
    assert error_of(post(limited.url, big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield json.dumps(big).encode()

    r = httpx.post(
        limited.url + "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    error_of(r, 413)
    assert post(limited.url).status_code == 200


def test_messages_limit(limited):
    body = {**CHAT, "messages": [{"role": "user", "content": "m"}] * 4}
    assert error_of(post(limited.url, body), 400)["param"] == "messages"


def test_full_queue_gets_429_with_retry_after(limited):
    long = {**CHAT, **NO_END, "max_tokens": 3000, "stream": True}
    opened, done = threading.Event(), threading.Event()

    def hold():  # one long stream, kept open until the second request has its answer
        with httpx.stream("POST", limited.url + "/v1/chat/completions", json=long, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 2:
                    opened.set()
                if done.is_set():
                    break

    holder = threading.Thread(target=hold)
    holder.start()
    assert opened.wait(30)
    r = post(limited.url)
    done.set()
    holder.join(60)
    assert error_of(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
    wait_until(lambda: limited.engine.in_flight == 0, seconds=30)
    assert post(limited.url).status_code == 200  # capacity is back


def test_no_end_bias_is_the_end_token(server):
    assert server.engine.tokenizer.eos_token_ids == {99}


def test_request_timeout(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", request_timeout=0.3) as live:
        r = post(live.url, {**CHAT, **NO_END, "max_tokens": 3500})
        assert error_of(r, 408)["type"] == "timeout_error"
        body = {**CHAT, **NO_END, "max_tokens": 3500, "stream": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["type"] == "timeout_error"
        assert post(live.url).status_code == 200


def test_streams_still_running_when_the_grace_period_ends_get_an_error_and_done(
    tiny_model_dir,
):
    proc, url = start_server(tiny_model_dir, "--shutdown-grace", "0.5")
    try:
        body = {**CHAT, **NO_END, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = iter(r.iter_lines())
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_finishes_running_streams_then_exits(tiny_model_dir):
    proc, url = start_server(tiny_model_dir, "--shutdown-grace", "20")
    try:
        body = {**CHAT, **NO_END, "max_tokens": 300, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = iter(r.iter_lines())
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the running stream was allowed to finish
        assert proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_plain_start_bounds_the_cache_by_the_memory_and_keeps_responses_private(
    tiny_model_dir, tmp_path
):
    from mlx_cache_server.runtime.memory import machine_memory
    from mlx_cache_server.serving.response_file import stored_responses_path
    from mlx_cache_server.settings import default_cache_bytes

    proc, url = start_server(tiny_model_dir, "--cache-dir", str(tmp_path))
    try:
        expected = default_cache_bytes(None, machine_memory())[0]
        assert httpx.get(url + "/v1/cache").json()["max_bytes"] == expected
        body = {"model": "tiny", "input": "Hi.", "max_output_tokens": 2}
        assert httpx.post(url + "/v1/responses", json=body, timeout=60).status_code == 200
        stored = stored_responses_path(tmp_path, "tiny")
        assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(stored.stat().st_mode) == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "(by default, an eighth of the" in proc.stdout.read()  # the start log says it
    finally:
        if proc.poll() is None:
            proc.kill()
