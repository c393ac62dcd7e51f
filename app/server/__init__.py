"""The HTTP server: the FastAPI app, its routes, authentication, errors and connections."""

from .app import build_engine, create_app

__all__ = ["build_engine", "create_app"]
