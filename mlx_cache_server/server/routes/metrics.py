"""GET /metrics, in Prometheus' text format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..auth import Admin
from ..state import State

router = APIRouter(tags=["metrics"], dependencies=[Admin])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
