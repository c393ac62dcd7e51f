"""The models one server serves: `--model` flags and the settings file's `[[models]]` tables.

A model is a `ModelSpec`: an id clients send, where its weights are, and the
settings it overrides for itself. The first model is the default: it answers to
`default`, takes the server-wide `--served-model-name` and `--model-alias`, and is
loaded at start. Every model's settings are the server's (sampling flags,
`--max-tokens`, `--context-length`, `--kv-bits` included) with its own overrides on
top (`ModelSpec.settings`), so one code path builds an engine for any of them.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..settings import Settings, coerce, parse_size

# What a [[models]] table may set for its model alone, and the setting it overrides.
OVERRIDES = {
    "context_length": "context_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_tokens": "default_max_tokens",
    "cache_max_sequences": "cache_max_sequences",
    "cache_max_bytes": "cache_max_bytes",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "chat_template_kwargs": "chat_template_kwargs",
}
OWN = {"id", "path", "aliases", "pinned", "ttl", "working_memory", "embedding", "pooling",
       "normalize"}  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    id: str  # the name clients send (`model`), and the cache's key for it
    path: str | None  # a folder, a Hugging Face id or a .gguf file; None: the embedded default
    aliases: tuple[str, ...] = ()  # more names clients may send for it
    pinned: bool = False  # loaded at start and never unloaded
    ttl: float | None = None  # idle seconds before it is unloaded; None: only for room
    working_memory: int | None = None  # bytes beyond weights and cache; None: the server's
    # An embedding model (/v1/embeddings): configured so, or found so from its
    # sentence-transformers files (mlx_cache_server/models/embedding.py).
    embedding: bool = False
    pooling: str | None = None  # "last" or "mean"; None: its files', else "last"
    normalize: bool = True
    overrides: dict[str, Any] = field(default_factory=dict, hash=False)  # Settings fields

    def settings(self, base: Settings) -> Settings:
        """The server's settings as this model runs with them (its template variables on
        top of the server's)."""
        overrides = dict(self.overrides)
        if "chat_template_kwargs" in overrides:
            overrides["chat_template_kwargs"] = {
                **base.chat_template_kwargs,
                **overrides["chat_template_kwargs"],
            }
        own = {"served_model_name": self.id, "model_aliases": list(self.aliases), **overrides}
        return base.model_copy(update=own)

    def names(self) -> set[str]:
        """Every name a request may use for this model."""
        names = {self.id, Path(self.id).name, *self.aliases}
        return {n for n in names if n}


@dataclass(frozen=True)
class ModelNames:
    """The names a request may use for one model (`name in names`): its own (`ModelSpec.names`,
    and `default` for the default model) and, where this is the model that answers names no
    model has (`--answer-any-model`), every name outside `taken`, the names the models have."""

    own: Set[str]
    taken: Set[str] | None = None  # None: this model answers to its own names alone

    def __contains__(self, name: object) -> bool:
        return name in self.own or (self.taken is not None and name not in self.taken)


def model_specs(settings: Settings, default_name: str) -> list[ModelSpec]:
    """The configured models, the default first; a ValueError says what is wrong."""
    specs = []
    if settings.model is None and settings.models:
        for flag in ("served_model_name", "model_aliases"):
            if getattr(settings, flag):
                raise ValueError(
                    f"{flag} names the model of --model; with [[models]] tables alone, give "
                    "each model its id and aliases in its table"
                )
    if settings.model is not None or not settings.models:
        path = settings.model
        specs.append(
            ModelSpec(
                id=settings.served_model_name or (model_id(path) if path else default_name),
                path=path,
                aliases=tuple(settings.model_aliases),
                ttl=settings.model_ttl,
            )
        )
    specs += [_from_table(t, i, settings) for i, t in enumerate(settings.models)]
    ids = [spec.id for spec in specs]
    for same in ids:
        if ids.count(same) > 1:
            raise ValueError(
                f"two models have the id {same!r} (two folders of that name, say); give "
                "each its own id in its [[models]] table"
            )
    seen: dict[str, str] = {}
    for spec in specs:
        for name in spec.names() | ({"default"} if spec is specs[0] else set()):
            if name in seen and seen[name] != spec.id:
                raise ValueError(
                    f"the name {name!r} is given to two models ({seen[name]} and {spec.id}); "
                    "give each model its own id and aliases"
                )
            seen[name] = spec.id
    if settings.draft_model and len(specs) > 1:
        raise ValueError("--draft-model drafts for one model: serve one model with it, or drop it")
    return specs


def _from_table(table: Any, i: int, settings: Settings) -> ModelSpec:
    where = f"[[models]] #{i + 1}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table with at least a path")
    unknown = set(table) - OWN - set(OVERRIDES)
    if unknown:
        known = ", ".join(sorted(OWN | set(OVERRIDES)))
        raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))}; known: {known}")
    path = table.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: 'path' (a folder, a hub id or a .gguf file) is required")
    aliases = table.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{where}: 'aliases' must be a list of names")
    ttl = table.get("ttl", settings.model_ttl)
    number = isinstance(ttl, int | float) and not isinstance(ttl, bool)  # true is an int too
    if ttl is not None and not (number and ttl > 0):
        raise ValueError(f"{where}: 'ttl' must be a positive number of seconds")
    for key in ("pinned", "embedding", "normalize"):
        if key in table and not isinstance(table[key], bool):
            raise ValueError(f"{where}: '{key}' must be true or false")
    working = table.get("working_memory")
    try:
        working = parse_size(working) if working is not None else None
    except ValueError as e:
        raise ValueError(f"{where}: 'working_memory': {e}") from None
    pooling = table.get("pooling")
    if pooling is not None and pooling not in ("last", "mean"):
        raise ValueError(f"{where}: 'pooling' is last or mean")
    overrides = {}
    for key, name in OVERRIDES.items():
        if key in table:
            try:  # a wrong type named here, not when the model first loads
                overrides[name] = coerce(name, table[key])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: '{key}': {e}") from None
    if not isinstance(overrides.get("chat_template_kwargs", {}), dict):
        raise ValueError(f"{where}: 'chat_template_kwargs' must be a table")
    return ModelSpec(
        id=str(table.get("id") or model_id(path)),
        path=path,
        aliases=tuple(aliases),
        pinned=table.get("pinned", False),
        ttl=float(ttl) if ttl is not None else None,
        working_memory=working,
        embedding=table.get("embedding", False) or pooling is not None,
        pooling=pooling,
        normalize=table.get("normalize", True),
        overrides=overrides,
    )


def check_paths(specs: list[ModelSpec]) -> None:
    """A ValueError for a model whose path is a local one that does not exist (at start, not
    when a request first names it; a hub id is only known when it is fetched)."""
    for spec in specs:
        if spec.path is not None and _looks_local(spec.path):
            if not Path(spec.path).expanduser().exists():
                raise ValueError(f"model {spec.id}: {spec.path} does not exist")


def _looks_local(path: str) -> bool:
    """A path, not a hub id (`org/name`): absolute, relative to here or home, or a file."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith(".gguf")


def model_id(path: str) -> str:
    """The id of a model named by its path: a folder's or file's name, or the hub id."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        return p.stem
    return p.name if p.exists() else path
