"""The real coding agents, installed from npm at pinned versions, each given nothing but our
base URL: Codex CLI through /v1/responses, Claude Code through /v1/messages and OpenCode
through /v1/chat/completions complete a non-interactive turn, and a second session is
served from the cache.

The model is `build_agent_model`: the tiny layers under the default model's tokenizer and
template (which knows no tools: the agents' tools go through the server's own protocol),
answering any chat with one fixed reply, so a turn ends as it would with a real model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CODEX, CLAUDE = "@openai/codex@0.171.0", "@anthropic-ai/claude-code@2.1.197"
OPENCODE = "opencode-ai@1.18.33"
REPLY = "Hello there!"  # what build_agent_model answers (tests/conftest.py)


@pytest.fixture(scope="module")
def clis(tmp_path_factory) -> Path:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm are needed to install the agent CLIs (.ci/run installs them)")
    folder = tmp_path_factory.mktemp("agents")
    subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), CODEX, CLAUDE,
         OPENCODE],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return folder / "node_modules" / ".bin"


def requests_logged(log: Path) -> list[dict]:
    lines = [line[line.index("{") :] for line in log.read_text().splitlines()
             if '"event": "request"' in line]  # fmt: skip
    return [json.loads(line) for line in lines]


def run(cmd: list[str], home: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC"))}
    return subprocess.run(
        cmd, cwd=home, env={**environ, "HOME": str(home), **env}, capture_output=True,
        text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def session_share(log: Path, before: int, route: str) -> float:
    """The cached share of the largest prompt a session sent on `route` (its turn: side
    requests, Claude Code's structured session title, are short and may be cut off)."""
    sent = [r for r in requests_logged(log)[before:] if r["route"] == route]
    largest = max(sent, key=lambda r: r["prompt_tokens"])
    assert largest["finish_reason"] == "stop", sent
    return largest["cached_tokens"] / largest["prompt_tokens"]


def test_codex_cli_completes_a_turn_and_a_second_session_is_cached(clis, agent_server, tmp_path):
    url, log = agent_server
    codex_home = tmp_path / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "local"\n\n[model_providers.local]\n'
        f'name = "local"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
    )
    cmd = [str(clis / "codex"), "exec", "--skip-git-repo-check"]
    env = {"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "unused"}
    first = run([*cmd, "Say hi."], tmp_path, **env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert REPLY in first.stdout
    before = len(requests_logged(log))
    second = run([*cmd, "What is in this folder?"], tmp_path, **env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert session_share(log, before, "/v1/responses") >= 0.9


def test_claude_code_completes_a_turn_and_a_second_session_is_cached(clis, agent_server, tmp_path):
    url, log = agent_server
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused"}
    first = run([str(clis / "claude"), "-p", "Say hi."], tmp_path, **env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert REPLY in first.stdout
    before = len(requests_logged(log))
    second = run([str(clis / "claude"), "-p", "What is in this folder?"], tmp_path, **env)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    # Its attribution line, different in every session, is cut by default.
    assert session_share(log, before, "/v1/messages") >= 0.9


def test_opencode_completes_a_turn_and_a_second_session_is_cached(clis, agent_server, tmp_path):
    url, log = agent_server
    config = tmp_path / ".config" / "opencode"
    config.mkdir(parents=True)
    # OpenCode's documented setup for a local OpenAI-compatible server; it fetches the
    # provider package from npm on first use.
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "local",
                "options": {"baseURL": f"{url}/v1", "apiKey": "unused"},
                "models": {"tiny": {"name": "tiny"}}}  # fmt: skip
    settings = {"provider": {"local": provider}, "model": "local/tiny", "autoupdate": False}
    (config / "opencode.json").write_text(json.dumps(settings))
    first = run([str(clis / "opencode"), "run", "Say hi."], tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert REPLY in first.stdout
    before = len(requests_logged(log))
    second = run([str(clis / "opencode"), "run", "What is in this folder?"], tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert session_share(log, before, "/v1/chat/completions") >= 0.9
