import sys

import pytest

from app.runtime.blas import describe, find_openblas, openblas_loaded


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_is_preloaded_when_installed():
    if find_openblas() is None:
        assert describe() == (describe()[0], False) and "reference" in describe()[0]
    else:
        assert openblas_loaded() and describe() == ("OpenBLAS (preloaded)", True)
