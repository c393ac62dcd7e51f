"""Sampling defaults for requests that leave a parameter out.

Chat UIs usually send no temperature; OpenAI's own default (1.0) makes small
models ramble. A left-out parameter takes, in order: the operator's setting
(`--temp` and the like), the model's `generation_config.json` (as vLLM does),
then OpenAI's neutral value. A request's own value always wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import Settings

# The values a generation_config.json may give too (`models.folders.SAMPLING_KEYS`).
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
