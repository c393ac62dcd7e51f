"""The disk tier's files: one KV segment each, in safetensors, checksummed.

A file holds, for each layer, that layer's arrays over one token range (axis 2),
named "<layer>.<array>". It is written under a temporary name and renamed, so a
crash leaves a whole file or none; its checksum is over the arrays it holds, so a
load verifies what it serves without reading the file twice.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from .disk_index import SUFFIX

Segment = tuple[tuple[mx.array, ...], ...]


class BadFile(Exception):
    """A file that cannot be served: missing, truncated, unreadable or corrupt."""


def write_segment(folder: Path, name: str, segment: Segment, meta: dict[str, str],
                  limit: int) -> tuple[int, str]:  # fmt: skip
    """Write `segment` as `folder/name.safetensors`; its size and checksum. OSError if it
    cannot be written or would exceed `limit` bytes (nothing is left behind then)."""
    # Contiguous copies: a slice of a longer segment is a strided view, which the
    # checksum cannot read as bytes.
    arrays = {f"{li}.{ai}": mx.contiguous(a) for li, layer in enumerate(segment)
              for ai, a in enumerate(layer)}  # fmt: skip
    final, tmp = folder / (name + SUFFIX), folder / f"{name}.tmp{SUFFIX}"
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        os.chmod(tmp, 0o600)
        size = tmp.stat().st_size
        if size > limit:
            raise OSError(f"a {size}-byte file over its {limit}-byte reservation")
        digest = checksum(arrays)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return size, digest


def read_segment(path: Path, nbytes: int, digest: str) -> list[list[mx.array]]:
    """The arrays of a file, by layer, verified against its size and checksum; BadFile
    saying why not."""
    try:
        if path.stat().st_size != nbytes:
            raise BadFile("is not the size it was written at")
        # MLX reads the file itself, once: through a Python file object it would take
        # the GIL under its allocator's lock, and another thread's mx.clear_cache()
        # (the engine releasing memory) then deadlocks with it.
        arrays = mx.load(str(path))
        mx.eval(list(arrays.values()))
    except BadFile:
        raise
    except Exception as e:  # a file that cannot be read or parsed is as bad as corrupt
        raise BadFile(f"cannot be read ({e})") from e
    if checksum(arrays) != digest:
        raise BadFile("does not match its checksum")
    layers: list[list[mx.array]] = []
    for name in sorted(arrays, key=lambda n: tuple(map(int, n.split(".")))):
        li, _ = map(int, name.split("."))
        while len(layers) <= li:
            layers.append([])
        layers[li].append(arrays[name])
    return layers


def join(pieces: list[Segment]) -> Segment:
    """Segments of consecutive token ranges as one."""
    if len(pieces) == 1:
        return pieces[0]
    return tuple(
        tuple(mx.concatenate(list(parts), axis=2) for parts in zip(*layers, strict=True))
        for layers in zip(*pieces, strict=True)
    )


def checksum(arrays: dict[str, mx.array]) -> str:
    """CRC-32 of the arrays' bytes, in name order: what a load would serve.

    Against disks and crashes, not attackers (the folder is the owner's alone): CRC-32
    runs at memory speed, where a cryptographic hash would halve the load bandwidth;
    over the arrays, not the file, so the file is read once (by MLX).
    """
    crc = 0
    for name in sorted(arrays):
        # As bytes: numpy has no bfloat16, and the buffer is all a checksum needs. A
        # strided view's bytes would not be the array's: copy it contiguous first.
        data = np.asarray(mx.contiguous(arrays[name]).view(mx.uint8))
        crc = zlib.crc32(np.ascontiguousarray(data), crc)
    return f"crc32:{crc:08x}"
