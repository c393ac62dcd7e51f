"""Server settings: defaults < config file (TOML) < environment < command-line flags."""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "MLX_CACHE_SERVER_"


@dataclass
class Settings:
    model: str | None = None  # a local folder or Hugging Face id; None: the embedded default
    served_model_name: str | None = None
    model_aliases: list[str] = field(default_factory=list)  # more names clients may send for it
    # More models, from the settings file's [[models]] tables (mlx_cache_server/models/specs.py).
    models: list[dict[str, Any]] = field(default_factory=list)
    model_ttl: float | None = None  # idle seconds before a model is unloaded; None: never
    memory_budget: int | None = None  # weights + caches + working memory of loaded models
    working_memory: int = 512 * 1024**2  # per model, beyond weights and cache, in the budget
    model_load_timeout: float = 300.0  # seconds a request waits for its model to load
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking
    host: str = "127.0.0.1"
    port: int = 8080
    cache_max_sequences: int = 64
    cache_max_bytes: int | None = None  # None: `default_cache_bytes`
    no_cache: bool = False
    cache_dir: str | None = None  # a disk tier under the cache, kept across restarts
    cache_disk_bytes: int = 16 * 1024**3  # its byte budget
    warm_prompts: str | None = None  # a JSON file of prompts prefilled at start
    context_length: int | None = None  # None: the model's own
    max_tokens_cap: int = 32768
    default_max_tokens: int = 2048
    # Sampling for requests that leave these out; None: the model's generation_config.json,
    # else OpenAI's neutral values (see mlx_cache_server/serving/defaults.py).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # Cut Claude Code's per-request attribution line from system prompts, so that its
    # conversations reuse the cache (serving/attribution.py); --keep-attribution-header
    # keeps it.
    strip_attribution_header: bool = True
    completion_batch_size: int = 16
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # On MLX's CPU device, the ops MLX's scalar exp slows (attention's softmax, the MLP's
    # SwiGLU, the logits' normalization) through numpy: mlx_cache_server/runtime/cpu_*.py.
    cpu_fast_path: bool = True
    # Streams verify prompt-lookup drafts (mlx_cache_server/engine/drafting.py).
    speculation: bool = True
    # A small model of the same tokenizer drafting where prompt lookup finds nothing.
    draft_model: str | None = None
    num_draft_tokens: int = 3
    kv_bits: int | None = None  # quantize the KV cache to this many bits; None: as the model
    kv_group_size: int = 64
    # Under `mlx.launch`: shard the model by layers (pipeline) rather than by heads (tensor).
    pipeline: bool = False
    # Seconds a sharded step may wait on the other processes before the server gives up on
    # them (a process that died mid-step can leave the others waiting forever).
    shard_timeout: float = 60.0
    max_prefill_wait: float = 10.0  # seconds a prompt may wait while shorter ones go first
    decode_gap: float = 0.8  # seconds a decoding stream should wait at most while prompts prefill
    log_level: str = "info"
    # Protection
    api_keys: list[str] = field(default_factory=list)  # none: no authentication
    admin_key: str | None = None  # for /v1/cache and /metrics; none: the API keys' rule
    cors_origins: list[str] = field(default_factory=list)  # none: no CORS headers
    ui: bool = True  # the chat page at / and the cache page at /ui/cache
    max_body_bytes: int = 8 * 1024**2
    max_messages: int = 1024
    max_queue: int = 256  # requests waiting beyond the decode batch; more get a 429
    request_timeout: float = 600.0
    shutdown_grace: float = 30.0
    max_connections: int = 1024  # connections past it are closed at once
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    body_timeout: float = 60.0  # seconds a client has to send a request's body
    write_timeout: float = 60.0  # seconds a response waits for a client that does not read


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '2GB', '1.5g' or a plain number."""
    if isinstance(text, bool):  # an int to Python: TOML's `true` would pass as 1 byte
        raise ValueError(f"not a size: {str(text).lower()} (try 512MiB or 2GB)")
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def coerce(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name in ("cache_max_bytes", "cache_disk_bytes", "max_body_bytes", "memory_budget",
                "working_memory"):  # fmt: skip
        return parse_size(value)
    if name == "models":
        if not isinstance(value, list):
            raise ValueError("expected [[models]] tables in the settings file")
        return value
    if name == "chat_template_kwargs":
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError("expected a table (a JSON object)")
        return value
    kind = {f.name: f.type for f in fields(Settings)}[name]
    numeric = kind.startswith("float") or ("int" in kind and "str" not in kind)
    if numeric and isinstance(value, bool):  # float(True) is 1.0: a typo would pass as 1
        raise ValueError(f"expected a number, not {str(value).lower()}")
    if kind.startswith("list"):
        items = value.split(",") if isinstance(value, str) else list(value)
        return [str(v).strip() for v in items if str(v).strip()]
    if kind.startswith("float"):
        return float(value)
    if "int" in kind and "str" not in kind:
        return int(value)
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
    return str(value)


def load_settings(config: Path | None, flags: dict[str, Any]) -> Settings:
    values: dict[str, Any] = {}
    if config is not None:
        with open(config, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - {f.name for f in fields(Settings)}
        if unknown:
            raise ValueError(f"unknown settings in {config}: {', '.join(sorted(unknown))}")
        values.update(data)
    for f in fields(Settings):
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if env is not None:
            values[f.name] = env
    values.update({k: v for k, v in flags.items() if v is not None})
    settings = Settings(**{k: _coerced(k, v) for k, v in values.items()})
    if not settings.model_load_timeout > 0:
        raise ValueError(f"model_load_timeout must be positive: {settings.model_load_timeout}")
    if settings.model_ttl is not None and not settings.model_ttl > 0:
        raise ValueError(f"model_ttl must be a positive number of seconds: {settings.model_ttl}")
    if not 0 < settings.decode_gap < float("inf"):
        raise ValueError(
            f"decode_gap must be a positive number of seconds, not {settings.decode_gap}"
        )
    return settings


def _coerced(name: str, value: Any) -> Any:
    try:
        return coerce(name, value)
    except (TypeError, ValueError) as e:  # named: the file may set dozens of them
        raise ValueError(f"{name}: {e}") from None


def describe_size(n: int | None) -> str:
    if n is None:
        return "no byte budget"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


FALLBACK_CACHE_BYTES = 2 * 1024**3  # where the machine's memory cannot be read


def default_cache_bytes(memory_budget: int | None, machine: int | None) -> tuple[int, str]:
    """The RAM cache's byte budget where none is set, and how it was chosen: a quarter of
    the models' memory budget (which counts it), else an eighth of the machine's memory
    (`machine`, None if unknown; the rest holds the weights, the requests' working memory
    and everything else running), so that no client can fill the machine with prompts."""
    if memory_budget is not None:
        return memory_budget // 4, "a quarter of --memory-budget"
    if machine is not None and machine > 0:
        return machine // 8, f"an eighth of the {describe_size(machine)} of memory here"
    return FALLBACK_CACHE_BYTES, "the machine's memory is unknown"
