"""POST /v1/embeddings, as OpenAI's: text or token inputs in, one vector per input out."""

from __future__ import annotations

import asyncio
import base64
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from ..models.embedding import Embedder
from ..settings import Settings
from .api_errors import APIError
from .metrics import Metrics
from .openai_bodies import TextRequest

MAX_INPUTS = 2048  # OpenAI's limits on one request: inputs, and tokens over all of them
MAX_TOKENS = 300_000


class EmbeddingRequest(TextRequest):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # the first N values, renormalized
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EmbeddingsServing:
    def __init__(self, embedder: Embedder, settings: Settings, metrics: Metrics) -> None:
        self.embedder, self.settings, self.metrics = embedder, settings, metrics
        # Its own thread: a long batch must not hold up the loop's executor, which every
        # chat request's templating goes through.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="embed")
        self._vocab = len(embedder.tokenizer.vocab)

    async def create(self, req: EmbeddingRequest) -> EmbeddingList:
        embedder = self.embedder
        if embedder.in_flight >= self.settings.max_queue:
            raise APIError(
                429,
                f"The server is busy: {embedder.in_flight} embedding requests are waiting. "
                "Retry shortly.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        if req.dimensions is not None and req.dimensions > embedder.width:
            raise APIError(
                400,
                f"dimensions must be at most {embedder.width} for this model.",
                param="dimensions",
            )
        embedder.in_flight += 1
        try:
            loop = asyncio.get_running_loop()
            inputs = await loop.run_in_executor(self._thread, self._tokens, req.input)
            vectors = await loop.run_in_executor(self._thread, embedder.embed, inputs)
        finally:
            embedder.in_flight -= 1
        tokens = sum(map(len, inputs))
        self.metrics.prompt_tokens.inc(tokens)
        data = [
            EmbeddingData(index=i, embedding=self._encode(v, req.dimensions, req.encoding_format))
            for i, v in enumerate(vectors)
        ]
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingList(data=data, model=req.model, usage=usage)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)  # queued work has no one waiting

    def _tokens(self, given: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """Each input's tokens, or a 400 naming the input that cannot be embedded."""
        if isinstance(given, str):
            given = [given]
        if not given:
            raise APIError(400, "input must not be empty.", param="input")
        if isinstance(given[0], int):
            given = [given]  # one input, as tokens
        if len(given) > MAX_INPUTS:
            raise APIError(
                400, f"At most {MAX_INPUTS} inputs per request; got {len(given)}.", param="input"
            )
        vocab, total = self._vocab, 0
        out = []
        for i, item in enumerate(given):
            if isinstance(item, str):
                tokens = list(self.embedder.tokenizer.encode(item)) if item else []
            else:
                tokens = list(item)
                if any(not 0 <= t < vocab for t in tokens):
                    raise APIError(
                        400, f"input[{i}] has a token outside the vocabulary.", param="input"
                    )
            if not tokens:
                raise APIError(400, f"input[{i}] is empty.", param="input")
            if len(tokens) > self.embedder.context_length:
                raise APIError(
                    400,
                    f"input[{i}] is {len(tokens)} tokens; this model takes at most "
                    f"{self.embedder.context_length}. Shorten it.",
                    param="input",
                    code="context_length_exceeded",
                )
            total += len(tokens)
            if total > MAX_TOKENS:
                raise APIError(
                    400,
                    f"The inputs are more than {MAX_TOKENS} tokens in all; send fewer at once.",
                    param="input",
                )
            out.append(tokens)
        return out

    def _encode(self, vector: list[float], dimensions: int | None, fmt: str) -> list[float] | str:
        if dimensions is not None:
            vector = vector[:dimensions]
            if self.embedder.pooling.normalize:  # as OpenAI's shortened vectors are
                norm = math.sqrt(sum(x * x for x in vector)) or 1.0
                vector = [x / norm for x in vector]
        if fmt == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        return vector
