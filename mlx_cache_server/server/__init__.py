"""The HTTP server: the FastAPI app, its routes, authentication, errors and connections."""

from .app import create_app
from .build import build_engine

__all__ = ["build_engine", "create_app"]
