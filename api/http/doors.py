"""The front doors this server has, registered in one place (`DOORS`).

A door is a package of `stepline.api` that exports `PREFIXES` (the paths it answers under),
`WIRE` (its error shape: `pipeline.errors.Wire`) and `routes(serving)` (a FastAPI router over
the shared pipeline). Its package imports no more than its wire, so that the app answering
while the model loads can answer each door's clients in their own shape.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

from fastapi.responses import Response

from stepline.api.pipeline.errors import OPENAI, APIError, Wire

DOORS = ("openai", "responses", "anthropic", "ollama", "sglang")


@cache
def doors() -> tuple[ModuleType, ...]:
    return tuple(importlib.import_module(f"stepline.api.{name}") for name in DOORS)


def wire_of(path: str) -> Wire:
    """The error shape a request to `path` gets, routed or not: its door's, else OpenAI's."""
    for door in doors():
        if path.startswith(door.PREFIXES):
            return door.WIRE
    return OPENAI


def error_response(path: str, err: APIError) -> Response:
    """`err` as the response to a request for `path`, in its door's shape."""
    return wire_of(path).response(err)
