"""How `ModelPool` fetches, opens, measures and closes a real model (`ModelLoader`), and
where a model's files are: a folder, a GGUF file's import, a hub id's download.

What a model is served as (a generating model's serving classes over its engine, an
embedding model's over its embedder) is the caller's: `ModelLoader` is handed `serve`,
which wraps what it loads, and reads back only what `Served` names.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from ..engine import Engine
from ..runtime import memory
from ..settings import Settings, default_cache_bytes, describe_size
from .embedding import Embedder, Pooling, sentence_transformers_pooling
from .engine_build import build_engine, context_length_of, weights_dtype
from .folders import model_folder
from .pool import FetchUnavailable
from .specs import ModelSpec

log = logging.getLogger("mlx_cache_server")


class _Describes(Protocol):
    def describe(self) -> str: ...


class Served(Protocol):
    """What `ModelLoader` reads of a model it serves (`serving.served_model.ServedModel`):
    a generating model's engine, or an embedding model's embedder."""

    spec: ModelSpec
    settings: Settings  # the server's, with the model's own overrides
    engine: Engine | None
    defaults: _Describes | None  # a generating model's sampling defaults, for the log

    @property
    def embedder(self) -> Embedder | None: ...
    def close_serving(self) -> None: ...  # what the serving classes run themselves, stopped


S = TypeVar("S", bound=Served)
# How a loaded model is served: its spec, its settings, and its engine or embedder in.
Serve = Callable[[ModelSpec, Settings, Engine | Embedder], S]


class ModelLoader(Generic[S]):
    """`Loader` for real models: built by `build_engine`, counted as weights + cache + working
    memory."""

    def __init__(self, settings: Settings, serve: Serve[S], group: Any = None) -> None:
        """`serve`: what a loaded model is served as; `group`: the processes of a sharded
        server (`sharding`), this one rank 0."""
        self.settings, self.serve, self.group = settings, serve, group
        self._kinds: dict[str, str] = {}
        self._fetched: dict[str, str] = {}  # model id: the folder it was fetched to
        self._fetching = threading.Lock()
        self._stuck = False

    def settings_of(self, spec: ModelSpec) -> Settings:
        settings = spec.settings(self.settings)
        if settings.cache_max_bytes is None:
            # An unbounded cache would make the budget meaningless, and one client's
            # distinct long prompts could fill the machine.
            budget, _ = self._default_cache_bytes(settings)
            settings = settings.model_copy(update={"cache_max_bytes": budget})
        return settings

    def _default_cache_bytes(self, settings: Settings) -> tuple[int, str]:
        return default_cache_bytes(settings.memory_budget, memory.machine_memory())

    def _cache_budget_origin(self, spec: ModelSpec) -> str | None:
        """How the cache's byte budget was chosen where no setting gave it, for the log."""
        settings = spec.settings(self.settings)
        if settings.cache_max_bytes is not None:
            return None
        return f"by default, {self._default_cache_bytes(settings)[1]}; --cache-max-bytes sets it"

    def kind(self, spec: ModelSpec) -> str | None:
        """What the model serves, known before loading it: "embedding" (configured so, or
        found so from its files) or "chat"; None while its files are not here (a hub id not
        downloaded yet): its fetch tells."""
        if spec.id not in self._kinds:  # read once: every request asks
            folder = self._folder(spec)
            if folder is None and not (spec.embedding or spec.pooling is not None):
                return None  # not kept: a guess now would outlive the download
            try:
                embedding = self._pooling(spec, folder) is not None
            except ValueError:  # an embedding model it cannot serve: its load says why
                embedding = True
            self._kinds[spec.id] = "embedding" if embedding else "chat"
        return self._kinds[spec.id]

    def fetch(self, spec: ModelSpec) -> None:
        """Download a hub id, import a GGUF file: before the pool plans the model's room,
        which then counts its weights as they will load, not a guess made without them."""
        here = local_folder(spec)
        on_disk = here is not None and _safetensors_bytes(here) > 0
        # One download or import at a time (an import holds the converted weights outside
        # the budget, and two downloads only share the bandwidth); a model on disk never waits.
        with contextlib.nullcontext() if on_disk else self._fetching:
            try:
                self._fetched[spec.id] = fetched_path(spec, log.info)
            except Exception as e:
                if may_recover(e):
                    raise FetchUnavailable(str(e)) from e
                raise

    def open(self, spec: ModelSpec) -> S:

        settings = self.settings_of(spec)
        # Fetched first (its files say what kind of model it is), as the pool does; again
        # here only if its folder went meanwhile.
        path = self._fetched.get(spec.id)
        if path is None or not Path(path).exists():
            path = fetched_path(spec, log.info)
        pooling = self._pooling(spec, Path(path))
        self._kinds[spec.id] = "embedding" if pooling is not None else "chat"
        if pooling is not None:
            return self.serve(spec, settings, self._open_embedder(spec, settings, path, pooling))
        engine = build_engine(settings, path, self.group)
        served = self.serve(spec, settings, engine)
        _describe(served, path, self._cache_budget_origin(spec))
        engine.start()
        return served

    def close(self, served: S) -> None:
        served.close_serving()
        engine = served.engine
        if engine is None:
            return
        engine.stop()
        if engine.alive:  # its thread is stuck in a step: its memory is not free either
            log.error("model %s: its engine did not stop within 10 s", engine.model_id)
        if engine.failure is not None:  # a sharded step stuck on a process that is gone:
            self._stuck = True  # freeing MLX's memory would wait on it forever
        if engine.cache is not None and engine.cache.disk is not None:
            engine.cache.disk.close(served.settings.shutdown_grace)  # what is queued, written

    def reclaim(self) -> None:
        if self._stuck:
            return
        gc.collect()  # a model's arrays are in reference cycles: collected, they are freed
        memory.release_memory()  # and MLX's pool and the heap give their pages back

    def estimate(self, spec: ModelSpec) -> int:
        embedding = self.kind(spec) == "embedding"
        weights = weights_on_disk(spec, self._fetched.get(spec.id))
        return weights + self._beside_weights(self.settings_of(spec), spec, embedding)

    def measure(self, served: S) -> int:
        from mlx.utils import tree_flatten

        model = served.engine.model if served.engine else served.embedder.model
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        return weights + self._beside_weights(served.settings, served.spec, served.engine is None)

    def requests(self, served: S) -> int:
        if served.engine is None:
            return served.embedder.in_flight
        engine = served.engine
        # Slots count what the server admitted; the engine's own counts also see what
        # runs without one (warm prompts) or has not left the batch yet (a cancellation).
        return max(engine.in_flight, engine.running + engine.waiting)

    def _folder(self, spec: ModelSpec) -> Path | None:
        fetched = self._fetched.get(spec.id)
        return Path(fetched) if fetched is not None else local_folder(spec)

    def _pooling(self, spec: ModelSpec, folder: Path | None = None) -> Pooling | None:
        folder = folder or local_folder(spec)
        found = sentence_transformers_pooling(folder) if folder is not None else None
        if not spec.embedding and spec.pooling is None:
            return found
        mode = spec.pooling or (found.mode if found is not None else "last")
        return Pooling(mode, spec.normalize)  # type: ignore[arg-type]

    def _open_embedder(
        self, spec: ModelSpec, settings: Settings, path: str, pooling: Pooling
    ) -> Embedder:
        import mlx.core as mx
        from mlx_lm import load

        from ..runtime import cpu_attention

        model, tokenizer = load(path)
        if _bidirectional(path):  # mlx-lm's ModelArgs drop the flag: its config keeps it
            raise ValueError(
                "it attends both ways (is_causal: false); mlx-lm runs it causally, so its "
                "vectors would be wrong"
            )
        if settings.cpu_fast_path and mx.default_device() == mx.cpu:
            cpu_attention.install(model)  # a long input's chunks over its KV, as prefill
        context = settings.context_length or context_length_of(model)
        embedder = Embedder(model, tokenizer, pooling, context)
        log.info(
            "model %s (%s): embeddings of %d values, %s pooling%s; context %d tokens",
            spec.id, path, embedder.width, pooling.mode,
            ", normalized" if pooling.normalize else "", context,
        )  # fmt: skip
        return embedder

    def _beside_weights(self, settings: Settings, spec: ModelSpec, embedding: bool = False) -> int:
        cache = 0 if settings.no_cache or embedding else settings.cache_max_bytes or 0
        working = spec.working_memory
        return cache + (working if working is not None else settings.working_memory)


def model_path(spec: ModelSpec, progress: Callable[[str], None] = lambda _: None) -> Path | str:
    """Where the model's MLX weights are: a folder, or a hub id for mlx-lm to fetch."""
    from .default_model import default_model_dir, gguf_model_dir

    if spec.path is None:
        return default_model_dir(progress)
    if spec.path.endswith(".gguf"):
        return gguf_model_dir(Path(spec.path), progress)
    local = Path(spec.path).expanduser()
    return local if local.exists() else spec.path


def fetched_path(spec: ModelSpec, progress: Callable[[str], None] = lambda _: None) -> str:
    """The model's folder on this machine: `model_path`'s, a hub id fetched first."""
    from ..mlx_adapter.hub import download

    return str(download(str(model_path(spec, progress))))


def may_recover(error: Exception) -> bool:
    """Whether a fetch that failed with `error` may succeed later: the hub unreachable (and
    the files not cached), or the hub's own failure (a 5xx, a 429); not a model that does not
    exist, a gated one, or a file that cannot be imported."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(error, LocalEntryNotFoundError):  # what the hub raises with no connection...
        return not constants.HF_HUB_OFFLINE  # ...or offline by choice: then it will not come
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", None)
        return status is None or status >= 500 or status == 429
    return isinstance(error, ConnectionError | TimeoutError)


def _bidirectional(path: str) -> bool:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("is_causal") is False


def local_folder(spec: ModelSpec) -> Path | None:
    """The model's folder if it is on disk already (a GGUF file's once imported)."""
    from .default_model import default_target, gguf_target

    try:
        if spec.path is None:
            return default_target()
        if spec.path.endswith(".gguf"):
            return gguf_target(Path(spec.path))
    except OSError:
        return None
    return model_folder(str(Path(spec.path).expanduser()))


def weights_on_disk(spec: ModelSpec, folder: str | None = None) -> int:
    """The bytes of the model's weight files (in `folder`, where it was fetched to), before
    it is loaded; 0 when not known.

    Before it is fetched, a GGUF file not imported yet counts its own size (its import
    makes it larger) and a hub id not downloaded counts nothing: the pool fetches a model
    before it plans its room, so only GET /v1/models shows those figures.
    """
    try:
        if folder is not None:
            return _safetensors_bytes(Path(folder))
        local = local_folder(spec)
        gguf = spec.path is not None and spec.path.endswith(".gguf")
        if gguf and (local is None or not local.exists()):  # not imported yet, or gone
            return Path(spec.path).expanduser().stat().st_size
        return _safetensors_bytes(local) if local is not None else 0
    except OSError:
        return 0


def _safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _describe(served: Served, path: str, budget_origin: str | None = None) -> None:
    """The startup log's lines about one model: what it runs on, samples with and caches."""
    import mlx.core as mx

    engine, settings = served.engine, served.settings
    log.info(
        "model %s (%s, %s weights) on %s; context %d tokens",
        engine.model_id, path, weights_dtype(engine.model), mx.default_device(),
        engine.context_length,
    )  # fmt: skip
    log.info("%s: sampling defaults: %s", engine.model_id, served.defaults.describe())
    if engine.cache is None:
        log.info("%s: prompt cache: off (--no-cache)", engine.model_id)
        return
    log.info(
        "%s: prompt cache: at most %d sequences, %s%s, %s",
        engine.model_id,
        settings.cache_max_sequences,
        describe_size(settings.cache_max_bytes),
        f" ({budget_origin})" if budget_origin else "",
        "full-precision KV"
        if settings.kv_bits is None
        else f"{settings.kv_bits}-bit KV in groups of {settings.kv_group_size}",
    )
    disk = engine.cache.disk
    if disk is not None:
        log.info(
            "%s: disk tier: %s, %s of %s (%d files restored)",
            engine.model_id, disk.folder, describe_size(disk.nbytes),
            describe_size(disk.max_bytes), disk.stats.files,
        )  # fmt: skip
