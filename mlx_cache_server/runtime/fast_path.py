"""The CPU fast path's switch, and the rules that pick which implementation runs each call.

On Linux, MLX's CPU backend computes `exp` one element at a time and builds RoPE and RMSNorm
out of many small ops; where that was measured to pay, the fast path runs an op on our
kernels (`native`: MLX primitives built at install) or through numpy instead, with the same
meaning (`python -m bench cpu-attention` measures attention and the activation both ways,
`python -m bench decode` the decode throughput with many streams; the decode steps' per-op
timings are in bench/README.md as of c01f1a1). `cpu_fast_path.install` puts the
entry points in a model; each entry point asks `FAST_PATH` which route a call takes and
runs that, nothing else. Every rule is a method below, one per family of ops:

    family     entry point                                routes, in the order tried
    attention  cpu_attention.scaled_dot_product_attention KERNEL, NUMPY_DECODE, NUMPY, MLX
    swiglu     cpu_activations.swiglu                     KERNEL, NUMPY, MLX
    logsumexp  cpu_logprobs.logsumexp                     NUMPY, MLX
    rope       kernel_layers.RoPE                         KERNEL, MLX
    rms_norm   kernel_layers.RMSNorm                      KERNEL, MLX
    block      kernel_block.Block                         KERNEL, MLX
    linear     kernel_linear.Linear, .Embedding           KERNEL, MLX

MLX is MLX's or mlx-lm's own code, what a model runs without the fast path. Ours is taken
only on float32 operands (and, but for RoPE and RMSNorm, which exist only in a model loaded
on it, on MLX's CPU device); KERNEL only where our kernels' module is there. A KERNEL route
is a promise to try: where a primitive refuses operands it cannot read (a weight replaced
by a view after the model was loaded), the entry point runs MLX's.

`on` is the switch (the `cpu_fast_path` setting, set by `models/engine_build.py`): off, every route
is MLX. `off` turns off a family ("attention") or one route of it ("attention.kernel"), for
tests and benchmarks that compare one part with MLX's. Both are process-wide, as the
entry points are (`mlx_adapter/model_patches.py` says why).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import mlx.core as mx

from . import kernel_attention, native


class Route(enum.Enum):
    MLX = "mlx"  # MLX's or mlx-lm's own
    KERNEL = "kernel"  # our primitive, a node of MLX's graph
    NUMPY = "numpy"  # numpy on the MLX arrays' buffers; attention: only its softmax
    NUMPY_DECODE = "numpy_decode"  # attention of a decode step, its matmuls in numpy too


# attention: scores of one call below which MLX's own kernel is as fast as numpy's softmax.
MIN_SCORES = 1 << 18
# attention: keys a sequence attends to beyond which a decode step is not numpy's: it was
# faster up to ~350 keys and slower from ~500 (in-process timings, in bench/README.md as of
# c01f1a1, "Decode steps' attention").
DECODE_MAX_KEYS = 384
# attention: a decode step's product (query heads a key head serves x head size x keys) past
# which numpy's OpenBLAS would spread it over its own threads, which spin beside MLX's.
DECODE_MAX_PRODUCT = 1 << 18
# swiglu: elements below which MLX's is as fast as numpy's round trip (a decode step of one
# or two streams on the default model's MLP).
MIN_ELEMENTS = 1 << 12
# logsumexp: rows below which MLX's normalizes. Numpy gains under a millisecond there, and
# its wait for the forward pass ends mlx-lm's overlap of the next step with this one's output.
MIN_ROWS = 3
MAX_ROWS = 64  # linear: rows our product takes, as `csrc/gemm.c`; the BLAS is faster past it


class FastPath:
    """The switch and the rules. Each rule reads only its call's operands, whether our
    kernels' module is there (`native.layers()`), `on` and `off`; none changes anything."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.off: frozenset[str] = frozenset()  # "family" or "family.route"

    def allows(self, family: str, route: Route) -> bool:
        return self.on and family not in self.off and f"{family}.{route.value}" not in self.off

    def kernels(self, family: str) -> ModuleType | None:
        """Our kernels' module, where it is there and `family` may run on it."""
        return native.layers() if self.allows(family, Route.KERNEL) else None

    def installs(self) -> bool:
        """Whether a model loaded now takes the entry points: on, on MLX's CPU device."""
        return self.on and mx.default_device() == mx.cpu

    def attention(
        self, queries: mx.array, keys: Any, values: Any, cache: Any, mask: Any, sinks: Any
    ) -> Route:
        """Ours: float32 queries, keys and values (no quantized cache), no attention sinks,
        a boolean or float32 mask. Then a few queries a sequence on our kernel; a decode step
        over a short context in numpy; enough scores for numpy's softmax to pay."""
        if hasattr(cache, "bits") or sinks is not None or not _cpu_float32(queries, keys, values):
            return Route.MLX
        if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, mx.float32):
            return Route.MLX
        b, heads, n_queries, dim = queries.shape
        kv_heads, n_keys = keys.shape[1], keys.shape[2]
        if self.kernels("attention") is not None and kernel_attention.takes(
            queries, keys, values, mask
        ):
            return Route.KERNEL
        product = (heads // kv_heads) * max(dim, values.shape[-1]) * n_keys
        if n_queries == 1 and n_keys <= DECODE_MAX_KEYS and product <= DECODE_MAX_PRODUCT:
            if self.allows("attention", Route.NUMPY_DECODE):
                return Route.NUMPY_DECODE
        if b * heads * n_queries * n_keys >= MIN_SCORES and self.allows("attention", Route.NUMPY):
            return Route.NUMPY
        return Route.MLX

    def swiglu(self, gate: mx.array, x: mx.array) -> Route:
        """Ours: float32 operands of one shape. Our kernel's node wherever it is there (the
        same bits as mlx-lm's); else numpy's from `MIN_ELEMENTS`."""
        if not _cpu_float32(gate, x) or gate.shape != x.shape or gate.ndim == 0:
            return Route.MLX
        if self.kernels("swiglu") is not None:
            return Route.KERNEL
        if gate.size >= MIN_ELEMENTS and self.allows("swiglu", Route.NUMPY):
            return Route.NUMPY
        return Route.MLX

    def logsumexp(self, a: mx.array, axis: int | None) -> Route:
        """Ours: float32 rows reduced along their last axis, at least `MIN_ROWS` of them."""
        if not (_cpu_float32(a) and a.ndim >= 1 and axis in (-1, a.ndim - 1)):
            return Route.MLX
        if a.shape[-1] == 0:
            return Route.MLX
        if a.size // a.shape[-1] >= MIN_ROWS and self.allows("logsumexp", Route.NUMPY):
            return Route.NUMPY
        return Route.MLX

    def rope(self, x: mx.array) -> Route:
        """Ours: float32 (batch, heads, positions, size)."""
        if x.dtype == mx.float32 and x.ndim == 4 and self.kernels("rope") is not None:
            return Route.KERNEL
        return Route.MLX

    def rms_norm(self, x: mx.array, weight: mx.array) -> Route:
        """Ours: float32 input and weight."""
        if x.dtype == mx.float32 and weight.dtype == mx.float32:
            return Route.KERNEL if self.kernels("rms_norm") is not None else Route.MLX
        return Route.MLX

    def block(self, x: mx.array, weights: Sequence[mx.array]) -> Route:
        """Ours: float32 (batch, positions, hidden) and float32 weights."""
        if x.ndim != 3 or not _cpu_float32(x, *weights) or self.kernels("block") is None:
            return Route.MLX
        return Route.KERNEL

    def linear(self, x: mx.array, weight: mx.array) -> Route:
        """Ours: float32, at most `MAX_ROWS` rows."""
        if x.ndim == 0 or x.size // max(x.shape[-1], 1) > MAX_ROWS:
            return Route.MLX
        if not _cpu_float32(x, weight) or self.kernels("linear") is None:
            return Route.MLX
        return Route.KERNEL


def _cpu_float32(*arrays: Any) -> bool:
    """Every one an `mx.array` of float32, on MLX's CPU device."""
    return mx.default_device() == mx.cpu and all(
        isinstance(a, mx.array) and a.dtype == mx.float32 for a in arrays
    )


FAST_PATH = FastPath()  # the one the entry points ask; `models/engine_build.py` sets `on`
