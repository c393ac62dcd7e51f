"""Two replicas behind sglang-router's cache-aware policy (the README's recipe): every turn
of a conversation lands on the replica that holds its previous turn, and the conversations
spread over both replicas. Through the `openai` SDK."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.live import free_port, serving

# As configs/replicas.sh starts it.
ROUTER_FLAGS = [
    "--balance-abs-threshold", "1", "--balance-rel-threshold", "1.1", "--cache-threshold", "0.05",
]  # fmt: skip


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny") as a:
        with serving(str(tiny_model_dir), served_model_name="tiny") as b:
            yield [a, b]


@pytest.fixture(scope="module")
def router(replicas):
    pytest.importorskip("sglang_router")  # in the test extra: present wherever the suite runs
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware",
         "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn",
         "--worker-urls", *(r.url for r in replicas), *ROUTER_FLAGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


def lookups(replica) -> int:
    stats = httpx.get(replica.url + "/v1/cache").json()
    return sum(m["lookups"] for m in stats["models"])


def test_each_conversation_stays_on_the_replica_that_holds_it(replicas, router):
    client = OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    topics = ["the sea", "a mountain", "the city at night", "an old library"]
    conversations = [[{"role": "user", "content": f"Tell me about {t}."}] for t in topics]
    previous = [0] * len(conversations)  # each conversation's last prompt, in tokens

    def turn(i: int, first: bool) -> None:
        messages = conversations[i]
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=48, temperature=0,
            logit_bias={"99": -100},  # 99: <|im_end|>: each reply takes a while
        )  # fmt: skip
        if not first:  # the previous turn's whole prompt came from this replica's cache
            assert r.usage.prompt_tokens_details.cached_tokens >= previous[i], i
        previous[i] = r.usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]

    # The first turns arrive together: the router spreads them by load.
    with ThreadPoolExecutor(len(conversations)) as pool:
        list(pool.map(lambda i: turn(i, first=True), range(len(conversations))))
    for _ in range(2):
        for i in range(len(conversations)):
            turn(i, first=False)
    counts = [lookups(r) for r in replicas]
    assert sum(counts) == 12 and min(counts) > 0, counts  # both replicas served conversations
