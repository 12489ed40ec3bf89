"""The Anthropic door: /v1/messages and /v1/messages/count_tokens (`serving`), with its request
bodies (`schema`) and its error shape (`wire`, used for every path under /v1/messages)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepline.api.anthropic.wire import ANTHROPIC as WIRE

if TYPE_CHECKING:
    from fastapi import APIRouter

    from stepline.api.pipeline.serving import Serving

PREFIXES = ("/v1/messages",)


def routes(serving: Serving) -> APIRouter:
    from stepline.api.anthropic.serving import router

    return router(serving)


__all__ = ["PREFIXES", "WIRE", "routes"]
