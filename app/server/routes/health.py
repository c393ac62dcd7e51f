"""GET /health"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ...serving.schemas import Health
from ..state import State

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, summary="Is the server able to serve?")
async def health(state: State):
    engine = state.engine
    body = Health(
        status="ok" if engine.alive else "unavailable",
        model=engine.model_id,
        running=engine.running,
        waiting=engine.waiting,
    )
    return JSONResponse(body.model_dump(), status_code=200 if engine.alive else 503)
