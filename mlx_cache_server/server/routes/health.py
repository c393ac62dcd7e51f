"""GET /health"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ...serving.openai_bodies import Health
from ..state import State

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, summary="Is the server able to serve?")
async def health(state: State):
    loaded = [m.served.engine for m in state.models.loaded() if m.served.engine is not None]
    alive = all(engine.alive for engine in loaded)
    body = Health(
        status="ok" if alive else "unavailable",
        model=state.models.default.id,
        running=sum(engine.running for engine in loaded),
        waiting=sum(engine.waiting for engine in loaded),
        # Open to all: which models a server has is for those with a key (GET /v1/models).
        models={}
        if state.settings.api_keys
        else {s.spec.id: s.status for s in state.models.states()},
    )
    return JSONResponse(body.model_dump(), status_code=200 if alive else 503)
