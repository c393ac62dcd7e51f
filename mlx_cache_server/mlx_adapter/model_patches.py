"""How the CPU fast path routes a loaded model's calls to ours (`runtime/cpu_fast_path.py`):
the only changes this server makes to mlx-lm's objects for it, each scoped to what it must
touch, each made when a model is loaded, never at import.

- `rebind`: mlx-lm's model modules call their building blocks by the name they import
  (`from .base import scaled_dot_product_attention`, `from .activations import swiglu`).
  Rebinding that name in the modules a model's parts come from routes their calls to ours;
  the function's own module (`base`, `activations`) keeps mlx-lm's, so callers that import
  it from there are untouched. A module is process-wide: every model of that module in
  this process calls ours from then on, and ours hands what it does not take back to
  mlx-lm's (`runtime/fast_path.py` decides, call by call).
- `route_generate`: `mlx_lm.generate` calls `mx.logsumexp` through its module global `mx`
  (its generators normalize every step's logits so). That global becomes a copy of
  `mlx.core`'s namespace holding ours under that name; `mlx.core` itself is left as it is,
  and nothing else in the process sees the change.
- `replace_modules` and `recast`: modules of one model's tree replaced by ours holding the
  same arrays, as `nn.quantize` does; only that model changes.

Each reliance on mlx-lm or MLX here has a contract test: tests/unit/test_mlx_adapter_models.py.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

M = TypeVar("M", bound=nn.Module)

# The module: `mlx_lm.generate` as an attribute of `mlx_lm` is the function of that name.
GENERATE = importlib.import_module("mlx_lm.generate")


def rebind(
    model: nn.Module, name: str, original: Callable, replacement: Callable, home: ModuleType
) -> bool:
    """Where a module of `model`'s parts binds `name` to mlx-lm's `original` (defined in
    `home`, left as it is), bind it to `replacement`; False if no module does. A module's
    own function of that name is left alone. A wrapper model (a VL model, SmolLM3) calls
    them from its language model's module, not its own: every part of the model is looked
    at."""
    found = False
    for part in [model, *model.modules()]:
        module = sys.modules.get(type(part).__module__)
        if module is None or module is home:
            continue
        current = getattr(module, name, None)
        if current is original or current is replacement:
            setattr(module, name, replacement)
            found = True
    return found


def called_by(part: nn.Module, name: str) -> Callable:
    """The function `name` as the module defining `part`'s class calls it: ours where
    `rebind` routed it."""
    return getattr(sys.modules[type(part).__module__], name)


def route_generate(name: str, replacement: Callable) -> bool:
    """Have `mlx_lm.generate` call `replacement` for `mx.<name>`; False if it did already."""
    if getattr(GENERATE.mx, name, None) is replacement:
        return False
    namespace = ModuleType(mx.__name__, mx.__doc__)
    namespace.__dict__.update(vars(mx))
    setattr(namespace, name, replacement)
    GENERATE.mx = namespace
    return True


def replace_modules(model: nn.Module, replacement: Callable[[Any], nn.Module | None]) -> int:
    """Put `replacement(child)` in place of each child module of `model` (and of its
    modules, lists of modules included) for which it is not None; how many were put.

    Children are replaced before their parents (`modules()` lists a module before what it
    holds), so a parent that `recast` replaces holds its children's replacements."""
    replaced = 0
    for module in reversed(model.modules()):  # `model` among them
        for key, value in list(module.items()):
            children = value if isinstance(value, list) else [value]
            for i, child in enumerate(children):
                ours = replacement(child)
                if ours is None:
                    continue
                if children is value:
                    value[i] = ours
                else:
                    module[key] = ours
                replaced += 1
    return replaced


def recast(module: nn.Module, kind: type[M]) -> M:
    """A `kind` (a subclass of `module`'s class) holding `module`'s arrays, child modules
    and attributes, the same objects: for `replace_modules` to put in its place."""
    ours = kind.__new__(kind)
    nn.Module.__init__(ours)
    vars(ours).update(vars(module))
    dict.update(ours, module)  # a module is a dict of its arrays and children
    return ours
