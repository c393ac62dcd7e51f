from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    from mlx_lm import load

    return load(str(tiny_model_dir))
