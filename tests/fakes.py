"""Real mlx-lm layer caches filled with values that encode the tokens they hold.

Key i of a layer is a function of token i; value i a running hash of tokens
[0, i]. A cache assembled from the wrong segments, in the wrong order or cut
at the wrong place therefore differs from `kv_cache(tokens)`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

N_LAYERS, N_HEADS, HEAD_DIM = 2, 2, 4
BYTES_PER_TOKEN = N_LAYERS * 2 * N_HEADS * HEAD_DIM * 4  # keys + values, float32


def _columns(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    keys = np.asarray(tokens, dtype=np.float32)
    running, acc = np.empty(len(tokens), dtype=np.float32), 0
    for i, t in enumerate(tokens):
        acc = (acc * 31 + t + 1) % 65521
        running[i] = acc
    return keys, running


def kv_cache(tokens: list[int], spare: int = 0) -> list[KVCache]:
    """A KV cache for `tokens`, with `spare` unused slots like a growing buffer has."""
    keys, running = _columns(tokens)
    n = len(tokens)
    out = []
    for layer in range(N_LAYERS):
        k = np.zeros((1, N_HEADS, n + spare, HEAD_DIM), dtype=np.float32)
        v = np.zeros_like(k)
        k[0, :, :n, :] = keys[None, :, None] + 1000 * layer
        v[0, :, :n, :] = running[None, :, None] + 7 * layer
        c = KVCache()
        c.keys, c.values, c.offset = mx.array(k), mx.array(v), n
        out.append(c)
    return out


def held(cache: list[KVCache]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The keys and values a cache holds for its tokens."""
    return [
        (np.array(c.keys[..., : c.offset, :]), np.array(c.values[..., : c.offset, :]))
        for c in cache
    ]


def same_state(a: list[KVCache], b: list[KVCache]) -> bool:
    return all(
        x.offset == y.offset and np.array_equal(kx, ky) and np.array_equal(vx, vy)
        for x, y, (kx, vx), (ky, vy) in zip(a, b, held(a), held(b), strict=True)
    )
