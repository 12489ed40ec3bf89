"""LoRA adapters loaded while serving: `POST /v1/load_lora_adapter` (vLLM's route and body,
`{"lora_name", "lora_path"}`, and stepline's `base_model`: which served model it adapts,
default the first). Only on a server with `--api-key`: the route reads a path on the server's
disk into its memory, so it is an administrator's. The adapter is then a model of its own in
/v1/models and /api/tags, run in its base model's batch (engine/lora.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from stepline.api.config import MODEL_NAME_PATTERN
from stepline.api.pipeline.errors import APIError

if TYPE_CHECKING:
    from stepline.api.pipeline.serving import Serving

log = structlog.get_logger(__name__)


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=MODEL_NAME_PATTERN)  # the `model` requests will send
    lora_path: str  # an mlx_lm.lora adapter directory on the server
    base_model: str | None = None  # the served model it adapts (default: the first)


def adapter_routes(serving: Serving) -> APIRouter:
    routes = APIRouter()
    models = serving.models

    @routes.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapter) -> JSONResponse:
        from stepline.api.request_error import RequestError
        from stepline.engine.lora import AdapterError

        if serving.config.api_key is None:
            raise APIError(
                403,
                "loading LoRA adapters while serving needs a server started with --api-key "
                "(or give them at start with --lora NAME=PATH)",
                code="forbidden",
            )
        if body.lora_name in models.names:
            raise APIError(400, f"the name {body.lora_name!r} is served already", param="lora_name")
        base = body.base_model or models.names[0]
        if models.entry_of(base) is None:
            served = ", ".join(repr(n) for n in models.listed)
            raise APIError(
                404, f"no model {base!r} to adapt: served are {served}", param="base_model"
            )
        entry: Any = await models.acquire(base)
        try:
            engine = entry.engine
            if body.base_model is not None and body.base_model in engine.adapters:
                raise APIError(400, f"{base!r} is an adapter, not a base model", param="base_model")
            info = await engine.load_adapter(body.lora_name, body.lora_path)
            models.adapter_loaded(entry, info.num_bytes)
        except (AdapterError, RequestError) as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_adapter") from None
        finally:
            models.release(entry)
        return JSONResponse(
            {
                "name": info.name,
                "base_model": entry.name,
                "kind": info.kind,
                "rank": info.rank,
                "num_modules": info.num_modules,
                "num_bytes": info.num_bytes,
            }
        )

    return routes
