"""How the server gets a fast BLAS and its kernels: OpenBLAS loaded into its own process
before MLX (no LD_PRELOAD, no re-execution), the kernels' module imported as an
extension; started from any folder, whatever packages that folder holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlx_cache_server.runtime import native
from mlx_cache_server.runtime.blas import describe, find_openblas, openblas_loaded
from tests.live import free_port

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="OpenBLAS and our kernels are Linux-only"
)


def test_the_suite_runs_on_openblas_when_installed():
    if find_openblas() is None:
        assert describe()[1] is False and "reference" in describe()[0]
    else:
        assert openblas_loaded() and describe() == ("OpenBLAS", True)


@pytest.mark.skipif(find_openblas() is None, reason="no OpenBLAS to load")
def test_openblas_serves_mlx_when_loaded_before_it_and_only_then():
    """MLX's matmul on OpenBLAS: its own threads appear (`openblas_get_num_threads` is
    found), and a float32 product of prefill's size is many times faster."""
    code = (
        "import ctypes, sys, time\n"
        "from mlx_cache_server.runtime import blas\n"
        "first = sys.argv[1] == 'blas-first'\n"
        "if not first: import mlx.core\n"
        "loaded = blas.use_openblas()\n"
        "import mlx.core as mx\n"
        "a, b = mx.random.normal((512, 1024)), mx.random.normal((1024, 1024))\n"
        "mx.eval(a @ b)\n"
        "t = time.perf_counter()\n"
        "for _ in range(5): mx.eval(a @ b)\n"
        "print(loaded, blas.why_not, time.perf_counter() - t)\n"
    )
    runs = {}
    for order in ("blas-first", "mlx-first"):
        out = subprocess.run(
            [sys.executable, "-c", code, order], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        loaded, *why, seconds = out.stdout.split()
        runs[order] = (loaded, " ".join(why), float(seconds))
    assert runs["blas-first"][:2] == ("True", "None")
    assert runs["mlx-first"][:2] == ("False", "MLX was imported before it")
    assert runs["blas-first"][2] * 4 < runs["mlx-first"][2], runs


def wait_for_health(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
        assert time.monotonic() < deadline, log.read_text()


def test_the_installed_command_serves_from_a_project_with_its_own_app(tiny_model_dir, tmp_path):
    """Started as its console script is, in a folder holding a FastAPI-style `app`
    package: the process is the server (its own command line, no LD_PRELOAD in its
    environment), and a child it starts inherits nothing of ours."""
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("print('the project app was imported')\n")
    (project / "app" / "__main__.py").write_text("print('the project app ran')\n")
    script = Path(sys.executable).with_name("mlx-cache-server")
    assert script.exists(), "the package is not installed in this environment"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH")}
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(script), "serve", "--model", str(tiny_model_dir), "--port", str(port),
             "--served-model-name", "tiny", "--log-level", "info"],
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", log)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "the project app" not in text
    assert not any(v.startswith(b"LD_PRELOAD=") for v in environ)
    assert str(script).encode() in cmdline  # the command the user ran, not a re-executed one
    if find_openblas() is not None:
        assert "libopenblas" in maps and "OpenBLAS" in text
    if native.layers() is not None:
        assert "_kernels_" in maps


def test_a_child_of_the_server_inherits_nothing_of_ours(tmp_path):
    """What a process that loaded OpenBLAS and our kernels the server's way passes on to
    a process it starts (a compiler, a browser, `mlx.launch`'s ranks): nothing."""
    code = (
        "import subprocess, sys\n"
        "from mlx_cache_server.runtime import blas, native\n"
        "blas.use_openblas()\n"
        "native.layers()\n"
        'child = \'import os; print(os.environ.get("LD_PRELOAD")); '
        'print(open("/proc/self/maps").read().count("_kernels_"))\'\n'
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, "
        "text=True).stdout)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "0"]
