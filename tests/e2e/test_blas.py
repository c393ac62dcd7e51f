import os
import subprocess
import sys

import pytest

from app.runtime import native
from app.runtime.blas import describe, find_openblas, openblas_loaded

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
        "from app.runtime.blas import reexec_preloaded\n"
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
