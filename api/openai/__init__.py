"""The OpenAI door: /v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings and
rerank (/v1/rerank, /v2/rerank, /rerank: Cohere's and Jina's shape) (`serving`), with their
request bodies (`schema`) and agent fields (`agents`). Errors are OpenAI's, the server's
default shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepline.api.pipeline.errors import OPENAI as WIRE

if TYPE_CHECKING:
    from fastapi import APIRouter

    from stepline.api.pipeline.serving import Serving

PREFIXES = (
    "/v1/chat/",
    "/v1/completions",
    "/v1/models",
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
)


def routes(serving: Serving) -> APIRouter:
    from stepline.api.openai.serving import router

    return router(serving)


__all__ = ["PREFIXES", "WIRE", "routes"]
