"""The benchmark harness's command lines: each kind of server is started as the suite says
(bench/harness.py), with the same cache limits where the server takes them. No server runs."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture
def harness(bench_script):
    return bench_script("harness")


def test_ours_and_the_peer_get_the_same_cache_limits(harness):
    ours = harness.command("ours", "M", 8000, 32, 1 << 20, ["--flag"])
    peer = harness.command("peer", "M", 8001, 32, 1 << 20, ["--flag"])
    assert ours[1:4] == ["-m", "mlx_cache_server", "serve"] and ours[-1] == "--flag"
    assert ours[ours.index("--cache-max-sequences") + 1] == "32"
    assert ours[ours.index("--cache-max-bytes") + 1] == str(1 << 20)
    assert peer[1:3] == ["-m", "mlx_lm.server"] and "--flag" not in peer
    assert peer[peer.index("--prompt-cache-size") + 1] == "32"
    assert peer[peer.index("--prompt-cache-bytes") + 1] == str(1 << 20)
    assert "--no-cache" in harness.command("ours-nocache", "M", 1, 1, 1, [])


def test_the_other_servers(harness, monkeypatch, tmp_path):
    assert harness.command("vlm", "M", 8002, 1, 1, [])[1:3] == ["-m", "mlx_vlm.server"]
    monkeypatch.setenv("LLAMA_SERVER", "/opt/llama-server")
    llama = harness.command("llama.cpp", "m.gguf", 8003, 1, 1, ["-t", "2"])
    assert llama[:3] == ["/opt/llama-server", "-m", "m.gguf"] and llama[-2:] == ["-t", "2"]
    # Another checkout's package: `app` before the server had a name of its own.
    (tmp_path / "app").mkdir()
    assert harness.command(f"ours@{tmp_path}", "M", 1, 1, 1, [])[2] == "app"


def test_percentile_and_turn_hits(harness):
    assert harness.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert harness.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == 5.0
    call = harness.Call
    # Conversation 0's second turn reused its whole first prompt; conversation 1's did not.
    calls = [
        call("w", 0, 0, 0, [], prompt_tokens=10),
        call("w", 0, 1, 1, [], cached_tokens=10),
        call("w", 1, 0, 2, [], prompt_tokens=10),
        call("w", 1, 1, 3, [], cached_tokens=4),
    ]
    assert harness.turn_hits(calls) == 0.5


def test_a_server_that_exits_is_said_in_one_line_from_its_log(harness, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "cli.py", line 1, in main\n'
        "FetchUnavailable: no snapshot of the model on the local disk\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    url = f"http://127.0.0.1:{harness.free_port()}"
    with pytest.raises(harness.ServerFailed) as failed:
        harness.wait_ready(url, [proc], "ours server", log=log)
    assert str(failed.value) == (
        "ours server exited with 3: FetchUnavailable: no snapshot of the model on the local "
        f"disk (its log: {log})"
    )
