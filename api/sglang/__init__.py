"""The SGLang worker door: what SGLang's model gateway (`sglang-router`) reads from a worker
beside the OpenAI routes it forwards — `/get_load` (its `power_of_two` policy), `/server_info`
and `/model_info` (the model it lists; `/get_server_info`, `/get_model_info` too). Errors
are OpenAI's. docs/gateway.md says how to run engines behind the gateway."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepline.api.pipeline.errors import OPENAI as WIRE

if TYPE_CHECKING:
    from fastapi import APIRouter

    from stepline.api.pipeline.serving import Serving

PREFIXES = ("/get_load", "/server_info", "/model_info", "/get_server_info", "/get_model_info")


def routes(serving: Serving) -> APIRouter:
    from stepline.api.sglang.serving import router

    return router(serving)


__all__ = ["PREFIXES", "WIRE", "routes"]
