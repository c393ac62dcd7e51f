"""The disk tier's files: one KV segment each, in safetensors, checksummed whole.

A file holds, for each layer, that layer's arrays over one token range (axis -2),
named "<layer>.<array>". It is written under a temporary name and renamed, so a
crash leaves a whole file or none.

Its checksum covers every byte of the file (the header's names, dtypes, shapes and
offsets as well as the arrays) and, before them, the facts of its index row that
decide what it is served as (`binding`: its path's tokens, namespace, range, layout
and name): a file read back as anything other than what was written, or a row
rewritten to serve it for other tokens or another tenant, fails the checksum. The
file is read once, by plain Python I/O into buffers of our own, checksummed as it is
read, and parsed here: nothing is served before its checksum matches, and any error
reading or parsing it is a `BadFile`.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from .disk_index import SUFFIX
from .kinds import width_of

Segment = tuple[tuple[mx.array, ...], ...]

_DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16",
           mx.int16: "I16", mx.uint32: "U32", mx.int32: "I32", mx.uint64: "U64",
           mx.int64: "I64", mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32"}  # fmt: skip
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


class BadFile(Exception):
    """A file that cannot be served: missing, truncated, unreadable or corrupt."""


def binding(name: str, namespace: str, start: int, end: int, layout: str, tokens: bytes) -> int:
    """The checksum a file's own checksum starts from: its index row's facts that decide
    what it is served as. A row rewritten in any of them no longer matches its file."""
    facts = json.dumps([name, namespace, start, end, layout]).encode()
    return zlib.crc32(tokens, zlib.crc32(facts + b"\0"))


def write_segment(folder: Path, name: str, segment: Segment, meta: dict[str, str],
                  limit: int, seed: int) -> tuple[int, str]:  # fmt: skip
    """Write `segment` as `folder/name.safetensors`; its size and checksum (from `seed`,
    its row's `binding`). OSError if it cannot be written or would exceed `limit` bytes
    (nothing is left behind then)."""
    # As bytes: numpy has no bfloat16. Contiguous copies: a slice of a longer segment
    # is a strided view, whose buffer is not the array's bytes.
    arrays = {f"{li}.{ai}": (a.dtype, a.shape, np.asarray(mx.contiguous(a).view(mx.uint8)))
              for li, layer in enumerate(segment) for ai, a in enumerate(layer)}  # fmt: skip
    header = _header(arrays, meta)
    size = len(header) + sum(data.nbytes for _, _, data in arrays.values())
    if size > limit:
        raise OSError(f"a {size}-byte file over its {limit}-byte reservation")
    final, tmp = folder / (name + SUFFIX), folder / f"{name}.tmp{SUFFIX}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as fh:
            crc = zlib.crc32(header, seed)
            fh.write(header)
            for _, _, data in arrays.values():
                data = np.ascontiguousarray(data).reshape(-1)
                crc = zlib.crc32(data, crc)
                fh.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return size, _digest(crc)


def _header(arrays: dict[str, tuple[Any, tuple[int, ...], np.ndarray]],
            meta: dict[str, str]) -> bytes:  # fmt: skip
    """A safetensors header: its length, then its JSON padded to 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, (dtype, shape, data) in arrays.items():
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + data.nbytes]}  # fmt: skip
        offset += data.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def read_segment(path: Path, nbytes: int, digest: str, seed: int, layout: str,
                 tokens: int) -> list[list[mx.array]]:  # fmt: skip
    """The arrays of a file, by layer, verified against its size, its checksum (from
    `seed`, its row's `binding`) and what `layout` stores of `tokens` tokens; BadFile
    saying why not."""
    try:
        # Read by Python into numpy buffers, never by MLX through a Python file object:
        # that takes the GIL under MLX's allocator lock, and another thread's
        # mx.clear_cache() (the engine releasing memory) then deadlocks with it.
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size != nbytes:
                raise BadFile("is not the size it was written at")
            arrays, crc = _read(fh, nbytes, seed)
        if _digest(crc) != digest:
            raise BadFile("does not match its checksum")
        return _layers(arrays, layout, tokens)
    except BadFile:
        raise
    except Exception as e:  # a file that cannot be read or parsed is as bad as corrupt
        raise BadFile(f"cannot be read ({type(e).__name__}: {e})") from e


def _read(fh: BinaryIO, nbytes: int, crc: int) -> tuple[dict[str, mx.array], int]:
    """The arrays of an open file and the checksum of its bytes, continuing `crc`."""
    head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= n <= nbytes - 8:
        raise BadFile("has a malformed header")
    text = fh.read(n)
    crc = zlib.crc32(text, zlib.crc32(head, crc))
    arrays = {}
    for name, dtype, shape, size in _entries(json.loads(text), nbytes - 8 - n):
        buf = np.empty(size, np.uint8)
        if fh.readinto(buf) != size:
            raise BadFile("is shorter than its header says")
        crc = zlib.crc32(buf, crc)
        arrays[name] = mx.array(buf).view(dtype).reshape(shape)
    return arrays, crc


def _entries(header: Any, data_bytes: int) -> list[tuple[str, Any, list[int], int]]:
    """(name, dtype, shape, bytes) of each array, in file order; BadFile unless their
    offsets tile the data exactly."""
    if not isinstance(header, dict):
        raise BadFile("has a malformed header")
    out = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = _BY_NAME[spec["dtype"]], spec["shape"]
        begin, end = spec["data_offsets"]
        if not all(type(d) is int and d >= 0 for d in (*shape, begin, end)):
            raise BadFile(f"has a malformed entry for {name!r}")
        if end - begin != math.prod(shape) * dtype.size:
            raise BadFile(f"gives {name!r} a size its shape does not have")
        out.append((begin, end, name, dtype, shape))
    out.sort()
    if [b for b, *_ in out] != [0] + [e for _, e, *_ in out[:-1]] or (
        (out[-1][1] if out else 0) != data_bytes
    ):
        raise BadFile("has arrays that do not tile its data")
    return [(name, dtype, shape, end - begin) for begin, end, name, dtype, shape in out]


def _layers(arrays: dict[str, mx.array], layout: str, tokens: int) -> list[list[mx.array]]:
    """The arrays by layer; BadFile unless they are what `layout` stores of `tokens` tokens:
    every layer, each with its kind's arrays, each over `tokens` tokens."""
    kinds = json.loads(layout)
    want = {f"{li}.{ai}" for li, (kind, *_) in enumerate(kinds)
            for ai in range(width_of(kind))}  # fmt: skip
    if set(arrays) != want:
        raise BadFile("does not hold the arrays its layout has")
    if any(a.ndim < 2 or a.shape[-2] != tokens for a in arrays.values()):
        raise BadFile(f"does not hold {tokens} tokens in every array")
    return [[arrays[f"{li}.{ai}"] for ai in range(width_of(kind))]
            for li, (kind, *_) in enumerate(kinds)]  # fmt: skip


def join(pieces: list[Segment]) -> Segment:
    """Segments of consecutive token ranges as one."""
    if len(pieces) == 1:
        return pieces[0]
    return tuple(
        tuple(mx.concatenate(list(parts), axis=2) for parts in zip(*layers, strict=True))
        for layers in zip(*pieces, strict=True)
    )


def _digest(crc: int) -> str:
    """CRC-32, against disks, crashes and careless edits, not attackers (the folder is
    the owner's alone): it runs at memory speed, where a cryptographic hash would halve
    the load bandwidth."""
    return f"crc32:{crc:08x}"
