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
    not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only"
)


def test_openblas_is_preloaded_when_installed():
    if find_openblas() is None:
        assert describe() == (describe()[0], False) and "reference" in describe()[0]
    else:
        assert openblas_loaded() and describe()[1]
        assert describe()[0].startswith("OpenBLAS (preloaded)")


@pytest.mark.skipif(find_openblas() is None, reason="no OpenBLAS: nothing to preload")
def test_a_process_reexecutes_itself_with_the_kernels_in_front_of_openblas():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    env.pop("MLX_CACHE_SERVER_BLAS_CHECKED", None)
    code = (
        "from mlx_cache_server.runtime.blas import reexec_preloaded\n"
        "reexec_preloaded(['-c', 'import os; print(os.environ[\"LD_PRELOAD\"])'])\n"
        "print('not re-executed')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    libs = out.stdout.split()
    if native.library() is None:  # no compiler here: OpenBLAS alone
        assert libs == [find_openblas()]
    else:
        assert libs == [str(native.library()), find_openblas()]  # the kernels first


def test_a_start_in_a_project_with_its_own_app_runs_the_server_without_a_usable_cache(
    tiny_model_dir, tmp_path
):
    """Started, as its console script does, in a folder holding another `app` package and
    with a cache home that cannot be created: the re-executed process is this server, on
    MLX's own path, and its log says why the kernels are off."""
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("print('the project app was imported')\n")
    (project / "app" / "__main__.py").write_text("print('the project app ran')\n")
    script = tmp_path / "mlx-cache-server"
    script.write_text("import sys\nfrom mlx_cache_server.cli import main\nsys.exit(main())\n")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in RE_EXEC_ENV}
    env["XDG_CACHE_HOME"] = str(blocker / "cache")
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), "serve", "--model", str(tiny_model_dir),
             "--port", str(port), "--served-model-name", "tiny"],
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", log)
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "the project app" not in text
    if find_openblas() is not None:  # re-executed, with OpenBLAS alone
        assert "our decode kernels are off (the kernel cache" in text
        assert text.count("Not a directory") == 2  # that line, and the extension's


RE_EXEC_ENV = ("LD_PRELOAD", "MLX_CACHE_SERVER_BLAS_CHECKED", "MLX_CACHE_SERVER_KERNELS_OFF",
               "MLX_CACHE_SERVER_NO_KERNELS")  # fmt: skip


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
