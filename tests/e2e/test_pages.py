"""The web pages as files and the cache page's JSON feed, over HTTP: what a browser gets,
who may read the cache, and `--no-ui`. The pages in a browser: test_pages_browser.py."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from mlx_cache_server.server.routes.ui import STATIC
from tests.live import serving


def test_the_chat_page_and_its_files_come_with_a_strict_policy(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert (
        "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    )
    assert page.headers["x-content-type-options"] == "nosniff"
    for name in re.findall(r'(?:src|href)="/ui/([\w.]+)"', page.text):
        asset = httpx.get(f"{server.url}/ui/{name}")
        assert asset.status_code == 200, name
    assert httpx.get(server.url + "/ui/cache").status_code == 200
    for bad in ("/ui/nothing.js", "/ui/..%2Fserver%2Fapp.py", "/ui/%2E%2E"):
        got = httpx.get(server.url + bad)
        assert got.status_code == 404 and got.json()["error"]["message"]


def test_a_name_too_long_to_open_is_a_404_and_stays_out_of_the_log(server, caplog):
    name = "a" * 5000 + ".js"
    got = httpx.get(f"{server.url}/ui/{name}")
    assert got.status_code == 404 and got.json()["error"]["code"] == "not_found"
    assert not any(name[:300] in record.getMessage() for record in caplog.records)
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_pages_ask_nothing_of_any_other_server():
    """Offline and under the policy: no URL of another host in any file."""
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://", text), path.name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text, path.name


def test_no_ui_serves_no_page(tiny_model_dir):
    with serving(str(tiny_model_dir), ui=False) as live:
        assert httpx.get(live.url + "/").status_code == 404
        assert httpx.get(live.url + "/ui/chat.js").status_code == 404
        assert httpx.get(live.url + "/health").status_code == 200


def test_the_tree_shows_the_prefix_two_turns_share_and_the_requests(server, client):
    turn = [{"role": "user", "content": "Zqx, the pages of this server?"}]  # unlike others
    first = client.chat.completions.create(model="tiny", messages=turn, max_tokens=6,
                                           temperature=0)  # fmt: skip
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And then?"}]  # fmt: skip
    second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=6,
                                            temperature=0)  # fmt: skip
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    # The session's server holds other tests' prompts too: all of its branches.
    view = httpx.get(server.url + "/v1/cache/tree?max_nodes=1000").json()
    assert view["enabled"] and view["ram"]["bytes"] > 0 and view["ram"]["sequences"] >= 1

    def all_branches(branches):
        for b in branches:
            yield b
            yield from all_branches(b["children"])

    branches = [b for ns in view["namespaces"] for b in all_branches(ns["branches"])]
    # The second turn's cached tokens end where a branch does: the prefix the turns share.
    assert any(b["depth"] == cached for b in branches)
    assert any("Zqx" in b["text"] for b in branches)
    assert all(b["tier"] == "ram" for b in branches)
    latest = view["requests"][0]
    assert latest["cached_tokens"] == cached and latest["route"] == "/v1/chat/completions"
    assert latest["prefill_ms"] is not None and latest["decode_ms"] is not None
    assert view["hit_rate"]["cached_tokens"] >= cached


def test_the_feed_sends_the_tree_as_an_event_and_is_admin_only(tiny_model_dir):
    with serving(str(tiny_model_dir), api_keys=["tenant"], admin_key="admin") as live:
        for path in ("/v1/cache/tree", "/v1/cache/events"):
            assert httpx.get(live.url + path).status_code == 401
            keyed = httpx.get(live.url + path, headers={"Authorization": "Bearer tenant"})
            assert keyed.status_code == 401 and keyed.json()["error"]["code"] == "invalid_api_key"
        admin = {"Authorization": "Bearer admin"}
        assert httpx.get(live.url + "/v1/cache/tree?max_nodes=0", headers=admin).status_code == 400
        assert httpx.get(live.url + "/v1/cache/tree?model=nope", headers=admin).status_code == 404
        with httpx.stream("GET", live.url + "/v1/cache/events", headers=admin, timeout=30) as feed:
            assert feed.headers["content-type"].startswith("text/event-stream")
            line = next(line for line in feed.iter_lines() if line.startswith("data: "))
        view = json.loads(line.removeprefix("data: "))
        assert view["enabled"] and view["namespaces"] == [] and view["requests"] == []
        assert view["models"] == [view["model"]]


def test_the_feed_sends_what_changed_only_and_ends_when_the_server_drains(tiny_model_dir):
    from mlx_cache_server.server.routes.cache import MAX_VIEWS

    with serving(str(tiny_model_dir), served_model_name="tiny") as live:
        for n in range(1, 3 * MAX_VIEWS):  # feeds of many sizes: only the last few views kept
            with httpx.stream("GET", f"{live.url}/v1/cache/events?max_nodes={n}") as feed:
                assert next(feed.iter_lines()).startswith("data: ")
        assert len(live.app.state.server.views) <= MAX_VIEWS
        timeout = httpx.Timeout(30, read=3.5)  # over three looks at the cache, under a keep-alive
        with httpx.stream("GET", live.url + "/v1/cache/events", timeout=timeout) as feed:
            lines = feed.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line that ends the event
            with pytest.raises(httpx.ReadTimeout):  # nothing changed: nothing sent
                next(lines)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(live.url + "/v1/chat/completions", json=body).status_code == 200
        with httpx.stream("GET", live.url + "/v1/cache/events", timeout=timeout) as feed:
            lines = feed.iter_lines()
            views = (json.loads(line.removeprefix("data: ")) for line in lines if line)
            # The first may be the view the last feed saw (views are shared for a second).
            view = next(v for v in views if v["requests"])
            assert view["namespaces"] and view["requests"][0]["completion_tokens"] > 0
            live.app.state.server.draining = True  # as shutdown begins
            assert [line for line in lines if line.startswith("data: ")] == []  # it ends
    with serving(str(tiny_model_dir), api_keys=["tenant"]) as live:  # no admin key: off
        got = httpx.get(live.url + "/v1/cache/tree", headers={"Authorization": "Bearer tenant"})
        assert got.status_code == 403


@pytest.mark.parametrize("path", ["/", "/ui/cache"])
def test_the_pages_are_not_in_the_api_schema(server, path):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert path not in schema["paths"]
    assert "/v1/cache/tree" in schema["paths"] and "/v1/cache/events" in schema["paths"]
