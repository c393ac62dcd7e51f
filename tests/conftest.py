from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mlx_cache_server.runtime.blas import use_openblas

# Like the server, the tests run MLX's CPU matmuls on OpenBLAS where it is installed:
# loaded before anything here imports MLX.
use_openblas()

from tests.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture
def bench_script(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], object]:
    """Import a script of bench/ afresh, by name: the scripts import each other as top-level
    modules, and the harness sets its own excepthook, put back after the test."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)

    def load(name: str) -> object:
        monkeypatch.delitem(sys.modules, name, raising=False)
        return importlib.import_module(name)

    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that knows tools (hermes-style, as Qwen2.5's)."""
    from tests.tiny_model import TOOLS_CHATML

    return build_tiny_model(tmp_path_factory.mktemp("tiny-tools"), chat_template=TOOLS_CHATML)


@pytest.fixture(scope="session")
def tiny_kv_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with heads of 32 values, the smallest group mx.quantize takes (for
    `--kv-bits`; the default tiny model's heads are 16)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-kv"), hidden_size=128)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    from mlx_lm import load

    return load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path):
    from tests.live import serving

    # Off: the tests on it ask for names it does not serve and expect the 404 (the default,
    # "auto", answers them with the one model served: tests/e2e/test_model_names.py).
    with serving(str(tiny_model_dir), served_model_name="tiny", answer_any_model="off") as live:
        yield live


@pytest.fixture(scope="session")
def uncached_server(tiny_model_dir: Path):
    from tests.live import serving

    with serving(str(tiny_model_dir), served_model_name="tiny", no_cache=True) as live:
        yield live


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def uncached_client(uncached_server):
    from openai import OpenAI

    return OpenAI(base_url=uncached_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def tools_live(tiny_tools_model_dir: Path):
    """A server on the tiny model whose template knows tools."""
    from tests.live import serving

    with serving(str(tiny_tools_model_dir), served_model_name="tiny") as live:
        yield live


@pytest.fixture(scope="session")
def tools_uncached(tiny_tools_model_dir: Path):
    from tests.live import serving

    with serving(str(tiny_tools_model_dir), served_model_name="tiny", no_cache=True) as live:
        yield live


@contextmanager
def _agent_serving(folder: Path, chat_template: str | None) -> Iterator[tuple[str, Path]]:
    """A server process on `build_agent_model` (the default model's tokenizer, answering
    every chat with "Hello there!"): its URL, and its log file (request lines)."""
    from mlx_cache_server.models.default_model import default_model_dir
    from tests.live import server_process
    from tests.tiny_model import build_agent_model

    model = build_agent_model(Path(default_model_dir()), folder / "model",
                              chat_template=chat_template)  # fmt: skip
    log = folder / "server.log"
    with server_process(model, log) as (_, url):
        yield url, log


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory: pytest.TempPathFactory):
    with _agent_serving(tmp_path_factory.mktemp("agent"), None) as served:
        yield served


@pytest.fixture(scope="session")
def agent_tools_server(tmp_path_factory: pytest.TempPathFactory):
    """The same with a chat template that knows tools (hermes-style)."""
    from tests.tiny_model import TOOLS_CHATML

    with _agent_serving(tmp_path_factory.mktemp("agent-tools"), TOOLS_CHATML) as served:
        yield served
