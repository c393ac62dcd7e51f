"""The `mlx-cache-server` command (also `python -m app`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("mlx_cache_server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-cache-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("--model", help="model folder or Hugging Face id (default: embedded)")
    serve.add_argument("--served-model-name", help="the model id clients use")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080)")
    serve.add_argument("--config", type=Path, help="a TOML settings file, see configs/")
    serve.add_argument("--cache-max-sequences", type=int, help="cached sequences at most")
    serve.add_argument("--cache-max-bytes", help="cache byte budget, e.g. 2GiB")
    serve.add_argument("--no-cache", action="store_true", default=None, help="serve uncached")
    serve.add_argument("--context-length", type=int, help="override the model's context")
    serve.add_argument("--log-level", help="debug, info, warning or error")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


def serve(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import uvicorn

    from .server import build_engine, create_app, limits_of
    from .settings import describe_size, load_settings

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        settings = load_settings(args.config, flags)
    except (OSError, ValueError) as e:
        print(f"mlx-cache-server: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model_path = settings.model
    if model_path is None:
        print("mlx-cache-server: no model given; pass --model PATH_OR_HF_ID", file=sys.stderr)
        return 2
    engine = build_engine(settings, model_path)
    log.info(
        "model %s (%s) on %s; context %d tokens",
        engine.model_id,
        model_path,
        mx.default_device(),
        engine.context_length,
    )
    if engine.cache is None:
        log.info("prompt cache: off (--no-cache)")
    else:
        log.info(
            "prompt cache: at most %d sequences, %s",
            settings.cache_max_sequences,
            describe_size(settings.cache_max_bytes),
        )
    engine.start()
    try:
        uvicorn.run(
            create_app(engine, limits_of(settings)),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
        )
    finally:
        engine.stop()
    return 0
