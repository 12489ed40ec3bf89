"""The Ollama door: Ollama's native API (`/api/chat`, `/api/generate`, `/api/tags`,
`/api/show`, `/api/ps`, `/api/version`, `/api/pull`, `/api/delete`), for the clients that
speak it (the `ollama` packages, Open WebUI, Continue, Raycast, Obsidian, Home Assistant):
request bodies in `schema`, handlers in `serving`, what the listings say of a model in
`facts`, errors in `wire`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepline.api.ollama.wire import OLLAMA as WIRE

if TYPE_CHECKING:
    from fastapi import APIRouter

    from stepline.api.pipeline.serving import Serving

PREFIXES = ("/api/",)


def routes(serving: Serving) -> APIRouter:
    from stepline.api.ollama.serving import router

    return router(serving)


__all__ = ["PREFIXES", "WIRE", "routes"]
