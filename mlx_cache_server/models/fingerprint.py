"""What makes stored KV valid, as one name: the disk tier's files live under it.

KV computed by one model is garbage to another, and even to the same weights in
another dtype or under another cache layout. The fingerprint covers the weights
(every file's name, size and modification time, and samples of its data: a
fine-tune changes them all), the dtype the weights are served in, the layer
cache types the model builds and the KV's quantization, MLX's and mlx-lm's versions
and the disk format's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_cache_server.prompt_cache.disk import FORMAT

SAMPLES = 16  # chunks of each weights file hashed, spread evenly
SAMPLE_BYTES = 64 * 1024


def kv_fingerprint(
    folder: Path | None,
    model_id: str,
    model: Any,
    kv: dict[str, Any] | None = None,
    served_as: str | None = None,
    images: str | None = None,
) -> str:
    """`kv`: how the KV is kept beyond the model's own layers (its quantization).
    `served_as`: the id the server serves it under, so that two ids on the same weights
    (one server, each with its own template options) each have a folder of their own.
    `images`: what encodes a vision model's images, with its version (the KV of an image
    is that library's output: another release may encode it otherwise)."""
    h = hashlib.blake2b(digest_size=16)
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    layers = [type(c).__name__ for c in make_prompt_cache(model)]
    facts = {"format": FORMAT, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
             "dtypes": dtypes, "layers": layers}  # fmt: skip
    if kv and kv.get("bits") is not None:  # unquantized keeps the fingerprints it had
        facts["kv"] = kv
    if served_as is not None:
        facts["served_as"] = served_as
    if images is not None:
        facts["images"] = images
    h.update(json.dumps(facts, sort_keys=True).encode())
    if folder is None:  # nothing on disk to read: the name has to do
        h.update(model_id.encode())
        return h.hexdigest()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".safetensors", ".json", ".gguf") and path.is_file():
            st = path.stat()  # a file rewritten in place changes its mtime
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
            _sample(path, h)
    return h.hexdigest()


def _sample(path: Path, h: Any) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
            return
        for i in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
