"""The OpenAI Responses door: /v1/responses and the responses it stores (`serving`), their
request body (`schema`), their events (`output`), and what a restart reads back from the event
log (`recovery`). Errors are OpenAI's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepline.api.pipeline.errors import OPENAI as WIRE

if TYPE_CHECKING:
    from fastapi import APIRouter

    from stepline.api.pipeline.serving import Serving

PREFIXES = ("/v1/responses",)


def routes(serving: Serving) -> APIRouter:
    from stepline.api.responses.serving import router

    return router(serving)


__all__ = ["PREFIXES", "WIRE", "routes"]
