"""Replacing modules in a model's tree, as `nn.quantize` does: the one way the CPU fast
path puts its modules in a model (`kernel_layers`, `kernel_linear`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def replace(model: Any, replacement: Callable[[Any], Any]) -> int:
    """Put `replacement(child)` in place of each child module of `model` (and of its
    modules, lists of modules included) for which it is not None; how many were put."""
    replaced = 0
    for module in model.modules():  # `model` among them
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
