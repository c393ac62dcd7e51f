"""The command re-executes itself (to preload its libraries) on the `app` it was started
from, never on an `app` package in the working folder, which `python -m app` would run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx_cache_server
from mlx_cache_server import cli


def project(tmp_path: Path) -> Path:
    """A folder holding a project's own `app` package, as a FastAPI project does."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("print('the project app was imported')\n")
    (tmp_path / "app" / "__main__.py").write_text("print('the project app ran')\n")
    return tmp_path


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # found as installed
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_re_executed_command_imports_the_same_app(tmp_path):
    args = cli._itself(["--help"])
    assert args[0] == "-P"  # the working folder is not on its path
    prelude = args[2].split("from mlx_cache_server.cli")[
        0
    ]  # what sets the path up, then: which app?
    probe = [*args[:2], prelude + "import mlx_cache_server; print(mlx_cache_server.__file__)"]
    out = run(probe, project(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == mlx_cache_server.__file__, out.stderr


def test_the_re_executed_command_runs_the_server_command(tmp_path):
    out = run(cli._itself(["--help"]), project(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "usage: mlx-cache-server" in out.stdout and "project app" not in out.stdout
