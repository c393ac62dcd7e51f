"""A model's folder on this machine, and the sampling values its generation_config.json
gives (which `serving.defaults` ranks below the operator's settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The sampling values a generation_config.json may give: `serving.defaults.NEUTRAL`'s keys.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


def model_folder(model: str) -> Path | None:
    """The local folder of a model path or an already downloaded Hugging Face id."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # not an id the hub library understands
        return None
    return Path(found).parent if isinstance(found, str) else None


def generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The sampling values of a model folder's generation_config.json ({} without one)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    if config.get("do_sample") is False:  # greedy, whatever temperature it also lists
        out["temperature"] = 0.0
    return out
