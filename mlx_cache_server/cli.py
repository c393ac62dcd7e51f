"""The `mlx-cache-server` command (also `python -m mlx_cache_server`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .setting_flags import add_setting_flags

if TYPE_CHECKING:
    from .serving.served_model import ServedModel
    from .settings import Settings

log = logging.getLogger("mlx_cache_server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-cache-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("--config", type=Path, help="a TOML settings file, see configs/")
    add_setting_flags(serve)  # every other flag: a setting's (mlx_cache_server/settings.py)
    imp = sub.add_parser("import-gguf", help="turn a llama/qwen2 GGUF file into an MLX folder")
    imp.add_argument("gguf", type=Path, help="the .gguf file")
    imp.add_argument("out", type=Path, help="the folder to write")
    imp.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="weights dtype (default: float32 on Linux, float16 on macOS)",
    )
    imp.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep Q4_0/Q4_1/Q8_0 tensors quantized instead of converting",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.command == "import-gguf":
        return import_command(args)
    return serve(args)


def import_command(args: argparse.Namespace) -> int:
    from .models.default_model import default_dtype
    from .models.gguf import GGUFError, import_gguf

    try:
        import_gguf(
            args.gguf,
            args.out,
            dtype=args.dtype or default_dtype(),
            keep_quantized=args.keep_quantized,
            progress=lambda line: print(line, file=sys.stderr),
        )
    except (GGUFError, OSError) as e:
        print(f"mlx-cache-server: {e}", file=sys.stderr)
        return 1
    return 0


def settings_of(args: argparse.Namespace) -> Settings:
    """The settings `serve`'s command line gives, over the environment's and the file's: its
    first --model is the `model` setting, the others more models after the file's."""
    from .settings import load_settings

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    paths = flags.pop("model") or []
    flags["model"] = paths[0] if paths else None
    settings = load_settings(args.config, flags)
    settings.models = settings.models + [{"path": p} for p in paths[1:]]
    return settings


def follow(settings: Settings, path: str, group: Any) -> int:
    """A rank other than 0: run the steps rank 0 hands over until it stops; the exit status."""
    from .models.engine_build import build_engine

    # Ctrl-C on the launcher reaches every rank: rank 0 drains its requests, then tells
    # this one to stop; stopping here first would fail them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = build_engine(settings, path, group)
    except ValueError as e:  # rank 0 says the same, and stops too
        log.error("%s", e)
        return 2
    with contextlib.suppress(ValueError):  # built now, not in a step rank 0 waits on
        engine.grammars.get()
    log.info("rank %d of %d (pid %d): following rank 0", group.rank(), group.size(), os.getpid())
    engine.run()  # here, on the main thread: this rank has nothing else to do
    if engine.failure is not None:
        log.error("rank %d stopped: %s", group.rank(), engine.failure)
        return 1
    return 0


def serve(args: argparse.Namespace) -> int:
    from .runtime.blas import use_openblas

    use_openblas()  # before MLX is imported, or its matmuls keep the reference BLAS
    import mlx.core as mx

    from .models.default_model import NAME
    from .models.loader import fetched_path
    from .models.sharding import launched_group, refusal, watch
    from .models.specs import check_paths, model_specs
    from .runtime.blas import describe as describe_blas
    from .runtime.memory import limit_buffer_pool
    from .server.app import create_app
    from .server.connections import uvicorn_config
    from .serving.metrics import Metrics
    from .serving.served_model import model_pool
    from .serving.warm import load_warm_prompts

    try:
        settings = settings_of(args)
        specs = model_specs(settings, NAME)
        check_paths(specs)
    except (OSError, ValueError) as e:
        print(f"mlx-cache-server: {e}", file=sys.stderr)
        return 2
    group = launched_group()
    if group is not None:
        why = refusal(settings, len(specs))
        if why is not None:
            print(f"mlx-cache-server: {why}", file=sys.stderr)
            return 2
        specs = [replace(specs[0], pinned=True)]  # every rank holds its shard until the end
    rank = f"rank {group.rank()} " if group is not None else ""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s",
    )
    if group is not None and group.rank() != 0:
        path = fetched_path(specs[0], log.info)  # a hub id fetched, as rank 0 does
        code = follow(specs[0].settings(settings), path, group)
        logging.shutdown()
        os._exit(code)  # as rank 0 ends: no interpreter teardown (see below)
    warm_items = []
    if settings.warm_prompts and not settings.no_cache:
        try:
            warm_items = load_warm_prompts(Path(settings.warm_prompts).expanduser())
        except ValueError as e:
            print(f"mlx-cache-server: {e}", file=sys.stderr)
            return 2
    limit_buffer_pool()
    blas, fast = describe_blas()
    if mx.default_device() == mx.cpu:
        (log.info if fast else log.warning)("CPU matmuls use %s", blas)
        log.info(
            "CPU fast path: %s",
            "on where the model calls mlx-lm's attention and SwiGLU or MLX's RoPE and"
            " RMSNorm modules, and for logprobs (--no-cpu-fast-path: off)"
            if settings.cpu_fast_path
            else "off: MLX's own kernels",
        )
    metrics = Metrics()
    pool = model_pool(settings, specs, metrics, group=group)
    try:
        for spec in [specs[0], *(s for s in specs[1:] if s.pinned)]:
            pool.open_now(spec.id)
    except (FileNotFoundError, ValueError) as e:  # a missing model; settings it cannot take
        print(f"mlx-cache-server: {e}", file=sys.stderr)
        pool.close()
        return 2
    for state in pool.states():
        log.info(
            "model %s: %s, %d MiB counted%s%s",
            state.spec.id,
            state.status,
            state.bytes >> 20,
            ", pinned" if state.spec.pinned else "",
            f", unloaded after {state.spec.ttl:g} s idle" if state.spec.ttl else "",
        )
    if settings.memory_budget is not None:
        log.info("memory budget for the models: %d MiB", settings.memory_budget >> 20)
    app = create_app(pool, settings=settings, metrics=metrics)

    def stop_engines() -> None:
        pool.stopping.set()
        for loaded in pool.loaded():
            if loaded.served.engine is not None:
                loaded.served.engine.stop()

    # On SIGTERM uvicorn stops accepting, gives running requests the grace period, then
    # cancels them (which cancels their generations); the engines stop after.
    def draining() -> None:
        app.state.server.draining = True

    from .server.graceful import GracefulServer

    server = GracefulServer(
        uvicorn_config(app, settings), stop_engines, settings.shutdown_grace, draining
    )
    failed = threading.Event()
    engine = None  # sharded: rank 0's engine
    if group is not None:
        log.info("rank 0 of %d: serving HTTP", group.size())
        engine = pool.get(specs[0].id).engine

        def shard_lost(why: str) -> None:  # from the engine's thread, or its watch
            if not failed.is_set():
                log.error("stopping: %s", why)
                failed.set()
                server.should_exit = True  # stops as on Ctrl-C, even before it runs; exit 1

        engine.on_failure = shard_lost
        if engine.failure is not None:  # it failed before it could say so
            shard_lost(engine.failure)
        watching = (engine, settings.shard_timeout, shard_lost)
        threading.Thread(target=watch, args=watching, daemon=True).start()
    if warm_items and pool.get(specs[0].id).engine is None:
        log.warning("--warm-prompts: the first model is an embedding model; nothing to warm")
    elif warm_items:  # behind the server's start: requests queue with them
        _start_warming(pool.get(specs[0].id), warm_items, settings)

    try:
        server.run()
    finally:
        if engine is None or engine.failure is None:
            pool.close()  # each engine stopped, each disk tier's queued writes written
        # Not closed after a failure: freeing MLX's memory would wait on the collectives of
        # a rank that is gone, forever. A failure found while closing counts too.
        if engine is not None and engine.failure is not None:
            failed.set()
    log.info("stopped")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: MLX's stream threads can abort the process while
    # C++ statics are destroyed (seen with mlx 0.32 on Linux), turning a clean stop
    # into a crash status. Upstream: https://github.com/ml-explore/mlx/pull/4110 (a fix,
    # closed unmerged); MLX asks each thread to call `mx.clear_streams()` before it ends
    # instead (https://github.com/ml-explore/mlx/pull/4373).
    os._exit(1 if failed.is_set() else 0)


def _start_warming(first: ServedModel, items: list, settings: Settings) -> None:
    """Warm the first model's cache on a thread of its own. A function, so that no frame of
    `serve` keeps the model alive after it is unloaded (the thread lets go when done)."""
    from .server.auth import tenant_of
    from .serving.warm import warm

    namespaces = [tenant_of(k) for k in settings.api_keys] or [None]
    warming = (
        first.engine, items, namespaces, settings.strip_attribution_header,
        first.settings.chat_template_kwargs,
    )  # fmt: skip
    threading.Thread(target=warm, args=warming, daemon=True).start()
