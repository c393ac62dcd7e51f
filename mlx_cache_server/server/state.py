"""What the server shares between requests, typed: one object on `app.state.server`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Depends
from starlette.requests import HTTPConnection

from ..models.pool import ModelBusy, ModelPool, ModelTooLarge, ModelUnavailable, UnknownModel
from ..serving.api_errors import APIError
from ..serving.metrics import Metrics
from ..serving.served_model import ServedModel
from ..settings import Settings


@dataclass
class ServerState:
    settings: Settings  # the one source of every limit
    metrics: Metrics
    started: int  # when the server started, as models' `created`
    models: ModelPool[ServedModel]
    # Set when shutdown begins: streams that never end by themselves (the cache page's
    # feed) end then, so that they do not hold the shutdown for its whole grace period.
    draining: bool = False
    # The cache page's latest view per (model, max_nodes), with when it was made: every
    # open feed shares one a second instead of each walking the tree.
    views: dict[Any, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def model(
        self, name: str, kind: Literal["chat", "embedding"] = "chat"
    ) -> AsyncIterator[ServedModel]:
        """The model a request names, loaded, held while the block runs; errors as the API's.

        `kind`: what the route needs, a model that generates text or one that embeds; the
        other kind is a 400, before anything is loaded when its files are here, else once
        they are (a hub id's kind is known only when it is downloaded). A name no model
        has may mean the default model (`answering`).
        """
        name = self.answering(name, kind)
        with pool_errors(self.models):
            spec = self.models.spec(name)
        known = self.models.loader.kind(spec)
        if known is not None and known != kind:
            raise APIError(400, _wrong_kind(spec.id, kind), param="model", code="wrong_model_type")
        with pool_errors(self.models):  # the block's own errors are never the pool's
            async with self.models.use(name) as served:
                if (served.engine is None) != (kind == "embedding"):  # its files said otherwise
                    raise APIError(
                        400, _wrong_kind(spec.id, kind), param="model", code="wrong_model_type"
                    )
                yield served

    def answering(
        self, name: str, kind: Literal["chat", "embedding"] = "chat", always: bool = False
    ) -> str:
        """The pool's name for the model a request's `name` means: a name no model has
        means the default model where the server answers such names (`--answer-any-model`;
        `always`: the request's API does so whatever the setting), unless the default is
        known to be of the other kind (it could not answer), when the name stays unknown."""
        if self.models.knows(name):
            return name
        default_kind = self.models.loader.kind(self.models.default)
        if default_kind is not None and default_kind != kind:
            return name
        return self.models.answering(name, always)


def _wrong_kind(model_id: str, wanted: str) -> str:
    if wanted == "embedding":
        return (
            f"The model '{model_id}' generates text and has no embeddings. Name an embedding "
            "model (GET /v1/models gives each model's type)."
        )
    return f"The model '{model_id}' is an embedding model: use POST /v1/embeddings."


@contextlib.contextmanager
def pool_errors(pool: ModelPool) -> Iterator[None]:
    """The pool's refusals as HTTP errors a client can act on."""
    try:
        yield
    except UnknownModel as e:
        served = ", ".join(sorted(s.id for s in pool.specs))
        raise APIError(
            404,
            f"The model '{e.args[0]}' does not exist. This server serves: {served}; "
            "list them with GET /v1/models.",
            param="model",
            code="model_not_found",
        ) from None
    except ModelBusy as e:
        raise APIError(409, str(e), code="model_busy") from None
    except ModelTooLarge as e:  # a 4xx: it never fits, so clients must not retry it
        raise APIError(400, str(e), param="model", code="model_too_large") from None
    except ModelUnavailable as e:
        raise APIError(
            503,
            str(e),
            type="service_unavailable",
            code="model_unavailable",
            headers={"Retry-After": "5"} if e.retry else None,
        ) from None


def server_state(request: HTTPConnection) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
