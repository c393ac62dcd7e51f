"""Sampling defaults for requests that leave a parameter out.

Chat UIs usually send no temperature; OpenAI's own default (1.0) makes small
models ramble. A left-out parameter takes, in order: the operator's setting
(`--temp` and the like), the model's `generation_config.json` (as vLLM does),
then OpenAI's neutral value. A request's own value always wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings import Settings

NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    source: str = "OpenAI's"  # where they came from, for the startup log

    def describe(self) -> str:
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}, "
            f"min_p {self.min_p:g} ({self.source})"
        )


def generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The sampling values of a model folder's generation_config.json ({} without one)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for key in NEUTRAL:
        value = config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    if config.get("do_sample") is False:  # greedy, whatever temperature it also lists
        out["temperature"] = 0.0
    return out


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


def sampling_defaults(settings: Settings, model_config: dict[str, Any]) -> SamplingDefaults:
    values: dict[str, Any] = dict(NEUTRAL)
    sources = set()
    for key in NEUTRAL:
        if getattr(settings, key) is not None:
            values[key], _ = getattr(settings, key), sources.add("settings")
        elif key in model_config:
            values[key], _ = model_config[key], sources.add("generation_config.json")
    source = " and ".join(sorted(sources)) if sources else "OpenAI's"
    return SamplingDefaults(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]),
        min_p=float(values["min_p"]),
        source=source,
    )
