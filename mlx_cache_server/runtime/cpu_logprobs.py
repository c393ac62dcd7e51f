"""Logits normalized into logprobs on MLX's CPU device through numpy, whose exp is vectorized.

Every sampled token first has its row of logits turned into logprobs, `logits -
logsumexp(logits)`: one `exp` per vocabulary entry, and on Linux MLX's CPU `exp` is
scalar, so with many streams this was, after the matmuls, among a decode step's largest
costs (bench/README.md, "Decode throughput with many streams"). mlx-lm's generators call
`mx.logsumexp` through their module's `mx`, so `install` gives `mlx_lm.generate` a copy
of `mlx.core`'s namespace holding this `logsumexp`; `mlx.core` itself is left as it is.

Each row is reduced on its own, so among steps of 3 streams or more a sequence's logprobs
never depend on which others share its step. One or two rows stay with MLX: numpy gains under
a millisecond there, and its wait for the forward pass ends mlx-lm's overlap of the next
step's forward pass with this step's output, which a server fills with the step's output
handling (which weighs more there was not measured through the servers). The two
normalizations differ in the last bits only; a greedy token is the largest logit either way
(unless subtracting rounds two logits into one).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import mlx.core as mx
import numpy as np

# The module: `mlx_lm.generate` as an attribute is the function of that name.
generate = importlib.import_module("mlx_lm.generate")

MIN_ROWS = 3  # fewer: MLX's (see above)

enabled = True  # off: every call goes to MLX's logsumexp


def logsumexp(a: mx.array, axis: int | None = None, keepdims: bool = False) -> mx.array:
    """`mx.logsumexp`, through numpy for float32 rows on the CPU."""
    if not (enabled and _eligible(a, axis)):
        return mx.logsumexp(a, axis=axis, keepdims=keepdims)
    mx.eval(a)
    x = np.asarray(a)
    top = x.max(axis=-1, keepdims=True)
    # A row without a finite largest value (all -inf, or an inf) is shifted by 0, so it
    # gives what MLX's gives: -inf, or inf.
    shift = np.where(np.isfinite(top), top, 0).astype(x.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = shift + np.log(np.exp(x - shift).sum(axis=-1, keepdims=True))
    return mx.array(out if keepdims else out[..., 0])


def _eligible(a: mx.array, axis: int | None) -> bool:
    return (
        mx.default_device() == mx.cpu
        and a.dtype == mx.float32
        and a.ndim >= 1
        and axis in (-1, a.ndim - 1)
        and a.shape[-1] > 0
        and a.size // a.shape[-1] >= MIN_ROWS
    )


def install() -> bool:
    """Route mlx-lm's generators' `logsumexp` here; False if it was routed already."""
    if getattr(generate.mx, "logsumexp", None) is logsumexp:
        return False
    namespace = ModuleType(mx.__name__, mx.__doc__)
    namespace.__dict__.update(vars(mx))
    namespace.logsumexp = logsumexp
    generate.mx = namespace
    return True
