"""Server settings: defaults < config file (TOML) < environment < command-line flags.

`Settings` declares each setting once: its form (mlx_cache_server/setting_types.py), default,
description and flags. The command line and the reference in docs/configuration.md are
generated from it (mlx_cache_server/setting_flags.py).

Not pydantic-settings' BaseSettings: that reads the environment whenever a `Settings` is
made, where code and tests make one with exactly the values they give; its TOML source
skips a missing file, where a missing --config is an error; its environment source reads
lists as JSON, where ours are separated by commas; and it merges tables across sources,
where a source sets a setting whole. `load_settings` reads the three sources itself.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .setting_types import AutoSwitch, Count, Flag, Names, Real, Size, Switch, Table, Tables, Text
from .setting_types import parse_size as parse_size  # where callers have always found it

ENV_PREFIX = "MLX_CACHE_SERVER_"


class Settings(BaseModel):
    """Every setting of the server, in the order the reference lists them. A setting with a
    `Flag` is set on the command line too; every one is a key of the TOML file and an
    environment variable (`ENV_PREFIX` and its name in capitals). Descriptions say what an
    unset (None) value means; they are the flags' --help and the reference's text."""

    # Unknown keys are refused; fields named model_* are settings, not pydantic's.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # One setting, one block: its form and flags, its default, its description.
    # fmt: off
    # Models
    model: Annotated[Text | None, Flag(action="append")] = Field(None, description=(
        "a model folder, Hugging Face id or .gguf file (unset: the embedded model); repeat "
        "the flag to serve several, loaded on first use; the first is the default"))
    served_model_name: Annotated[Text | None, Flag()] = Field(None, description=(
        "the id clients use for the first model (unset: its folder's name or hub id)"))
    model_aliases: Annotated[Names, Flag("--model-alias")] = Field([], description=(
        "more names clients may send for the first model, e.g. gpt-4o"))
    # Agents given only a base URL ask for their own default model (gpt-*, claude-*).
    answer_any_model: Annotated[AutoSwitch, Flag()] = Field("auto", description=(
        "answer a model name no model here has with the default model, logged once per "
        "name (the reply names the model asked for; GET /v1/models lists the real ids): "
        "auto is on when one model is served, off when several are; off: such a name is a "
        "404, model_not_found"))
    models: Tables = Field([], description=(
        "more models: the settings file's [[models]] tables (configs/models.example.toml)"))
    model_ttl: Annotated[Real | None, Flag()] = Field(None, description=(
        "unload a model idle this many seconds (unset: never)"))
    memory_budget: Annotated[Size | None, Flag()] = Field(None, description=(
        "bytes all loaded models may take (weights, caches, working memory), e.g. 16GiB: "
        "loading one that does not fit unloads the least recently used idle ones (unset: no "
        "budget)"))
    working_memory: Annotated[Size, Flag()] = Field(512 * 1024**2, description=(
        "bytes a model takes beyond weights and cache, counted in --memory-budget"))
    model_load_timeout: Annotated[Real, Flag()] = Field(300.0, description=(
        "seconds a request waits for its model to load"))
    chat_template_kwargs: Table = Field({}, description=(
        "the chat template's variables, e.g. { enable_thinking = false } (a JSON object in "
        "the environment)"))
    # Listening
    host: Annotated[Text, Flag()] = Field("127.0.0.1", description="the address to bind")
    port: Annotated[Count, Flag()] = Field(8080, description="the port to bind")
    # Prompt cache
    cache_max_sequences: Annotated[Count, Flag()] = Field(64, description=(
        "cached sequences at most"))
    cache_max_bytes: Annotated[Size | None, Flag()] = Field(None, description=(
        "the cache's byte budget, e.g. 2GiB (unset: a quarter of --memory-budget, else an "
        "eighth of the machine's memory)"))
    no_cache: Annotated[Switch, Flag()] = Field(False, description="serve uncached")
    cache_dir: Annotated[Text | None, Flag()] = Field(None, description=(
        "a folder for the cache's disk tier, kept across restarts (unset: no disk tier)"))
    cache_disk_bytes: Annotated[Size, Flag()] = Field(16 * 1024**3, description=(
        "the disk tier's byte budget"))
    warm_prompts: Annotated[Text | None, Flag()] = Field(None, description=(
        "a JSON file of prompts to prefill at start"))
    # Requests' limits and sampling defaults
    context_length: Annotated[Count | None, Flag()] = Field(None, description=(
        "the context length, overriding the model's own"))
    max_tokens_cap: Count = Field(32768, description=(
        "the most max_tokens a request may ask for (more: a 400)"))
    default_max_tokens: Annotated[Count, Flag("--max-tokens")] = Field(2048, description=(
        "max_tokens when a request sends none"))
    # Unset: the model's generation_config.json, else OpenAI's neutral values
    # (mlx_cache_server/serving/defaults.py).
    temperature: Annotated[Real | None, Flag("--temp")] = Field(None, description=(
        "temperature when a request sends none (unset: the model's generation config)"))
    top_p: Annotated[Real | None, Flag()] = Field(None, description=(
        "top_p when a request sends none (unset: the model's generation config)"))
    top_k: Annotated[Count | None, Flag()] = Field(None, description=(
        "top_k when a request sends none (unset: the model's generation config)"))
    min_p: Annotated[Real | None, Flag()] = Field(None, description=(
        "min_p when a request sends none (unset: the model's generation config)"))
    # So that Claude Code's conversations reuse the cache (serving/attribution.py).
    strip_attribution_header: Annotated[
        Switch,
        Flag("--strip-attribution-header", "store_true", help=(
            "cut Claude Code's per-request x-anthropic-billing-header line from system "
            "prompts (the default)")),
        Flag("--keep-attribution-header", "store_false", help=(
            "keep Claude Code's attribution line: each of its conversations then shares "
            "nothing in the cache with another")),
    ] = Field(True, description=(
        "cut Claude Code's per-request x-anthropic-billing-header line from system prompts "
        "(kept: each of its conversations shares nothing in the cache with another)"))
    # Continuous batching
    completion_batch_size: Count = Field(16, description="streams decoding together at most")
    prefill_batch_size: Count = Field(8, description="prompts prefilling together at most")
    prefill_step_size: Count = Field(512, description="the largest prefill chunk, in tokens")
    max_prefill_wait: Real = Field(10.0, description=(
        "seconds a prompt may wait while shorter ones go first"))
    decode_gap: Annotated[Real, Flag()] = Field(0.8, description=(
        "seconds running streams should wait at most while prompts prefill"))
    # Decoding (mlx_cache_server/runtime/cpu_*.py, engine/drafting.py)
    cpu_fast_path: Annotated[Switch, Flag(help=(
        "on the CPU, keep MLX's own softmax, SwiGLU and logprobs (slower on Linux)"
    ))] = Field(True, description=(
        "on MLX's CPU device, attention's softmax, the MLP's SwiGLU and the logprobs' "
        "normalization through numpy's exp, which MLX's scalar exp slows (off: MLX's own)"))
    speculation: Annotated[Switch, Flag(help=(
        "decode one token a step always: no prompt-lookup drafts (same output, slower)"
    ))] = Field(True, description=(
        "verify prompt-lookup drafts: several tokens a step where the context predicts "
        "them, the same output as one a step"))
    draft_model: Annotated[Text | None, Flag()] = Field(None, description=(
        "a small model of the same tokenizer (a folder or hub id) that drafts a lone "
        "stream's next tokens where prompt lookup finds none"))
    num_draft_tokens: Annotated[Count, Flag()] = Field(3, description=(
        "tokens the draft model drafts a step"))
    kv_bits: Annotated[Count | None, Flag()] = Field(None, description=(
        "keep the KV cache quantized to 8 or 4 bits (2, 3, 5, 6 too): more context per byte "
        "(unset: as the model)"))
    kv_group_size: Annotated[Count, Flag()] = Field(64, description=(
        "values per quantization group of --kv-bits"))
    # Sharded under `mlx.launch` (docs/scale-out.md)
    pipeline: Annotated[Switch, Flag()] = Field(False, description=(
        "under mlx.launch: split the model's layers over the processes (off: split every "
        "layer's heads)"))
    # A process that died mid-step can leave the others waiting forever.
    shard_timeout: Annotated[Real, Flag()] = Field(60.0, description=(
        "under mlx.launch: seconds a step may wait on the other processes before the server "
        "takes them for dead and stops"))
    log_level: Annotated[Text, Flag()] = Field("info", description=(
        "debug, info, warning or error"))
    # Protection
    api_keys: Annotated[Names, Flag("--api-key")] = Field([], description=(
        "Bearer keys to require, each a tenant with its own cache namespace (none: open)"))
    admin_key: Annotated[Text | None, Flag()] = Field(None, description=(
        "the key for /v1/cache and /metrics (unset: the API keys' rule)"))
    cors_origins: Annotated[Names, Flag("--cors-origin")] = Field([], description=(
        "origins browser requests may come from, or * (none: no CORS headers)"))
    ui: Annotated[Switch, Flag(help=(
        "serve no web page at / (the chat page) and /ui/cache (the cache page)"
    ))] = Field(True, description=(
        "serve the chat page at / and the cache page at /ui/cache"))
    max_body_bytes: Annotated[Size, Flag()] = Field(8 * 1024**2, description=(
        "the largest request body"))
    # Images (a vision model's; docs/vision.md)
    max_images: Count = Field(16, description="most images in one request")
    max_image_pixels: Count = Field(4096 * 4096, description=(
        "most pixels (width x height) of one image, read from its header before decoding"))
    fetch_image_urls: Annotated[Switch, Flag()] = Field(False, description=(
        "fetch images that requests name by http(s) URL (off: data URLs only; a fetch is a "
        "request the server makes to wherever a client names)"))
    max_messages: Annotated[Count, Flag()] = Field(1024, description=(
        "most messages in one chat request"))
    max_queue: Annotated[Count, Flag()] = Field(256, description=(
        "requests waiting beyond the decode batch; more get a 429"))
    request_timeout: Annotated[Real, Flag()] = Field(600.0, description=(
        "seconds a generation may take"))
    shutdown_grace: Annotated[Real, Flag()] = Field(30.0, description=(
        "seconds running requests get to finish on SIGTERM"))
    max_connections: Annotated[Count, Flag()] = Field(1024, description=(
        "open connections at most; those past it are closed at once"))
    header_timeout: Annotated[Real, Flag()] = Field(10.0, description=(
        "seconds a client has to send a request's headers"))
    body_timeout: Real = Field(60.0, description=(
        "seconds a client has to send a request's body"))
    write_timeout: Annotated[Real, Flag()] = Field(60.0, description=(
        "seconds a response waits for a client that stopped reading"))
    # fmt: on


def coerce(name: str, value: Any) -> Any:
    """`value` read as setting `name` is (None stays None); a ValueError says why not."""
    if value is None:
        return None
    try:
        return getattr(Settings.model_validate({name: value}), name)
    except ValidationError as e:
        raise ValueError(_reasons(e, named=False)) from None


def load_settings(config: Path | None, flags: dict[str, Any]) -> Settings:
    """The settings from the TOML file `config`, then the environment, then `flags` (those
    not None), each over the one before; a ValueError names each setting that is wrong."""
    values: dict[str, Any] = {}
    if config is not None:
        with open(config, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - set(Settings.model_fields)
        if unknown:
            raise ValueError(f"unknown settings in {config}: {', '.join(sorted(unknown))}")
        values.update(data)
    for name in Settings.model_fields:
        env = os.environ.get(ENV_PREFIX + name.upper())
        if env is not None:
            values[name] = env
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        settings = Settings(**values)
    except ValidationError as e:  # named: the file may set dozens of them
        raise ValueError(_reasons(e, named=True)) from None
    if not settings.model_load_timeout > 0:
        raise ValueError(f"model_load_timeout must be positive: {settings.model_load_timeout}")
    if settings.model_ttl is not None and not settings.model_ttl > 0:
        raise ValueError(f"model_ttl must be a positive number of seconds: {settings.model_ttl}")
    if not 0 < settings.decode_gap < float("inf"):
        raise ValueError(
            f"decode_gap must be a positive number of seconds, not {settings.decode_gap}"
        )
    return settings


def _reasons(error: ValidationError, named: bool) -> str:
    """What is wrong with each value, as the forms' validators say it (`named`: after its
    setting's name); pydantic's own wording where no validator spoke."""
    reasons = []
    for e in error.errors():
        reason = e["msg"].removeprefix("Value error, ")
        if e["type"] != "value_error":
            reason = f"{reason}: {e['input']!r}"
        reasons.append(f"{e['loc'][0]}: {reason}" if named and e["loc"] else reason)
    return "; ".join(reasons)


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
