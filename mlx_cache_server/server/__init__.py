"""The HTTP server: the FastAPI app, its routes, authentication, errors and connections."""

from .app import create_app

__all__ = ["create_app"]
