"""FastAPI dependencies for the state a server shares between requests."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .engine import Engine


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]
