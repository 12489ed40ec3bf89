"""The routes of the SGLang worker door (see the package docstring).

`GET /get_load`: a JSON array with one object per engine (one; a server of several models,
one per loaded model), in SGLang's shape: `num_reqs` (requests in flight), `num_waiting_reqs`
(not yet started) and `num_tokens` (their prompt and output tokens: what they hold or will
hold in the KV cache). The gateway's `power_of_two` sends a request to the less loaded of
two workers by the sum of `num_tokens`.

`GET /server_info`, `/model_info` (and the `get_` names): the served model's name
(`served_model_name`, what the gateway lists in its `/v1/models`), its context, its mlx-lm
`model_type`, stepline's version. No `model_path`: the gateway would try to fetch a
tokenizer from it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

if TYPE_CHECKING:
    from stepline.api.engine import Engine
    from stepline.api.pipeline.serving import Serving


def engine_load(engine: Engine, dp_rank: int = 0) -> dict[str, int]:
    """One engine's load in SGLang's `/get_load` shape."""
    load = engine.snapshot  # as the step loop published it
    return {
        "dp_rank": dp_rank,
        "num_reqs": load.num_live,
        "num_waiting_reqs": load.num_waiting,
        "num_tokens": load.num_tokens,
    }


def _stepline_version() -> str:
    try:
        return version("stepline")
    except PackageNotFoundError:  # a source tree not installed
        return "unknown"


def router(serving: Serving) -> APIRouter:
    routes = APIRouter()

    def engines() -> list[Engine]:
        return [e.engine for e in serving.models.loaded() if e.engine is not None]

    @routes.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [engine_load(e, i) for i, e in enumerate(engines())]

    async def info() -> dict[str, Any]:
        body: dict[str, Any] = {
            "served_model_name": serving.model_name,
            "served_model_names": list(serving.served_model_names),
            "is_generation": True,
            "tp_size": 1,
            "dp_size": 1,
            "version": _stepline_version(),
        }
        loaded = engines()
        if loaded:  # a server of several models may have none loaded now
            engine = loaded[0]
            body["context_length"] = body["max_context_length"] = engine.max_context
            model_type = getattr(engine.loaded.model, "model_type", None)
            if isinstance(model_type, str):
                body["model_type"] = model_type
        return body

    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        routes.add_api_route(path, info, methods=["GET"], include_in_schema=True)
    return routes
