"""Routing a model's calls of an mlx-lm function to ours, at the name its modules call.

mlx-lm's model modules import their building blocks by name (`from .base import
scaled_dot_product_attention`, `from .activations import swiglu`), so rebinding that
name in a model module's namespace is the extension point that changes no mlx-lm
file. A wrapper model (a VL model, SmolLM3) calls them from its language model's
module, not its own: every part of the model is looked at.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def rebind(
    model: Any, name: str, original: Callable, replacement: Callable, home: ModuleType
) -> bool:
    """Where a module of `model`'s parts binds `name` to mlx-lm's `original` (defined in
    `home`, left as it is), bind it to `replacement`; False if no module does. A module's
    own function of that name is left alone."""
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
