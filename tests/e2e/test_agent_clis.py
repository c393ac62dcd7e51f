"""The real coding agents, installed from npm at the releases pinned below, each given nothing
but our base URL: Codex CLI through /v1/responses (over its WebSocket, with only
`openai_base_url`), Claude Code through /v1/messages and OpenCode through
/v1/chat/completions complete a non-interactive turn, and a second session, in another
folder, is served from the cache. OpenCode and the Agents SDK (installed from PyPI at its pin)
given only `OPENAI_BASE_URL` complete a turn with their own models' names.

The model is `build_agent_model`: the tiny layers under the default model's tokenizer and
template (which knows no tools: the agents' tools go through the server's own protocol),
answering any chat with one fixed reply, so a turn ends as it would with a real model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The releases the tests run (the newest when last updated), in this one place; the
# recorded requests in tests/fixtures/agents/ name theirs. docs/coding-agents.md's figures
# are these releases'.
CODEX = "@openai/codex@0.171.0"
CLAUDE = "@anthropic-ai/claude-code@2.1.332"
OPENCODE = "opencode-ai@1.18.33"
AGENTS_SDK = "openai-agents==0.24.0"
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


@pytest.fixture(scope="module")
def agents_sdk(tmp_path_factory) -> Path:
    """A folder holding the Agents SDK at its pin with its dependencies, for PYTHONPATH."""
    folder = tmp_path_factory.mktemp("agents-sdk")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", str(folder), AGENTS_SDK],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if installed.returncode != 0:
        pytest.skip(f"{AGENTS_SDK} could not be installed: {installed.stderr[-500:]}")
    return folder


def requests_logged(log: Path) -> list[dict]:
    lines = [line[line.index("{") :] for line in log.read_text().splitlines()
             if '"event": "request"' in line]  # fmt: skip
    return [json.loads(line) for line in lines]


def run(
    cmd: list[str], home: Path, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """`cmd` as a user runs it, with `home` for its HOME and configuration, in `cwd` (its
    home by default)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC"))}
    return subprocess.run(
        ["nice", "-n", "10", *cmd], cwd=cwd or home, env={**environ, "HOME": str(home), **env},
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def session_share(log: Path, before: int, route: str) -> float:
    """The cached share of the largest prompt a session sent on `route` (its turn: side
    requests, Claude Code's structured session title, are short and may be cut off)."""
    sent = [r for r in requests_logged(log)[before:] if r["route"] == route]
    largest = max(sent, key=lambda r: r["prompt_tokens"])
    assert largest["finish_reason"] == "stop", sent
    return largest["cached_tokens"] / largest["prompt_tokens"]


def refused(log: Path, since: int) -> list[str]:
    """The 4xx answers in the server's log (uvicorn's access lines) after its first `since`
    characters: an agent's retries and fallbacks show there."""
    lines = log.read_text()[since:].splitlines()
    return [line for line in lines if re.search(r'"\s+4\d\d\b', line)]


def another_folder(tmp_path: Path) -> Path:
    """A working folder that is not the first session's (the agents name theirs in their
    system prompts)."""
    folder = tmp_path / "elsewhere" / "project"
    folder.mkdir(parents=True)
    return folder


def test_codex_cli_with_only_a_base_url_uses_the_websocket_and_is_cached(
    clis, agent_server, tmp_path
):
    """No provider table: Codex's own `openai` provider at our URL opens the Responses API's
    WebSocket first, asks for its own model (answered by the served one) and completes its
    turn with no 4xx: no refused upgrade, no fallback to HTTP."""
    url, log = agent_server
    since = len(log.read_text())
    cmd = [str(clis / "codex"), "exec", "--skip-git-repo-check", "-c",
           f"openai_base_url={url}/v1"]  # fmt: skip
    env = {"CODEX_HOME": str(tmp_path / ".codex"), "OPENAI_API_KEY": "unused"}
    (tmp_path / ".codex").mkdir()
    first = run([*cmd, "Say hi."], tmp_path, **env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert REPLY in first.stdout
    before = len(requests_logged(log))
    second = run([*cmd, "What is in this folder?"], tmp_path, another_folder(tmp_path), **env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert session_share(log, before, "/v1/responses") >= 0.9
    served = log.read_text()[since:]
    assert '"WebSocket /v1/responses" [accepted]' in served
    assert "POST /v1/responses" not in served  # never fell back
    assert not refused(log, since)


def test_claude_code_completes_a_turn_and_a_second_session_is_cached(clis, agent_server, tmp_path):
    url, log = agent_server
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused"}
    first = run([str(clis / "claude"), "-p", "Say hi."], tmp_path, **env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert REPLY in first.stdout
    before = len(requests_logged(log))
    second = run([str(clis / "claude"), "-p", "What is in this folder?"], tmp_path,
                 another_folder(tmp_path), **env)  # fmt: skip
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    # Its attribution line, different in every session, is cut by default; its folder
    # (its memory's path, early in the system prompt) comes after the tools, which the
    # server's tool protocol writes first. What differs after that is its own: a system
    # message after the user's words (environment, agent types, skills).
    assert session_share(log, before, "/v1/messages") >= 0.6


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
    second = run([str(clis / "opencode"), "run", "What is in this folder?"], tmp_path,
                 another_folder(tmp_path))  # fmt: skip
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    # Its `Working directory:` line, deep in the system prompt, comes after the tools.
    assert session_share(log, before, "/v1/chat/completions") >= 0.6


def test_opencode_with_only_openai_base_url_completes_a_turn(clis, agent_server, tmp_path):
    """No provider configured: OpenCode's own `openai` provider asks for its own model over
    the Responses API, and the served model answers it."""
    url, log = agent_server
    since = len(log.read_text())
    env = {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "unused"}
    done = run([str(clis / "opencode"), "run", "Say hi."], tmp_path, **env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert REPLY in done.stdout
    assert not refused(log, since)


SDK_TURN = """
from agents import Agent, Runner, set_tracing_disabled

set_tracing_disabled(True)  # traces go to OpenAI's servers
print(Runner.run_sync(Agent(name="helper", instructions="Be brief."), "Say hi.").final_output)
"""


def test_the_agents_sdk_with_only_openai_base_url_completes_a_turn(
    agents_sdk, agent_server, tmp_path
):
    """Its default client and model (the Responses API, a model of OpenAI's), as a script
    given nothing but the environment's base URL and key."""
    url, log = agent_server
    since = len(log.read_text())
    env = {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "unused",
           "PYTHONPATH": str(agents_sdk)}  # fmt: skip
    done = run([sys.executable, "-c", SDK_TURN], tmp_path, **env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert REPLY in done.stdout
    assert not refused(log, since)
