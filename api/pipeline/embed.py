"""Embeddings, for every door that serves them (OpenAI's `/v1/embeddings`, Ollama's
`/api/embed` and `/api/embeddings`): a call's inputs checked, each one a request of its own in
the engine (`Engine.embed`: a prefill-only request, chunked under the step budget), all of a
call's submitted together so that they share steps, and their vectors (cut to `dimensions`
and normalised again where asked). What a door parses and renders is its own; the checks and
their errors are here, once.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stepline.api.pipeline.errors import APIError, known_error
from stepline.api.pipeline.served import RequestContext

if TYPE_CHECKING:
    from stepline.api.pipeline.serving import Serving
    from stepline.api.prompts import Prepared

MAX_INPUTS = 2048  # of one call (OpenAI's limit)
MAX_IN_FLIGHT = 64  # of one call's inputs in the engine at once (the rest wait their turn)

Input = str | list[int]


@dataclass(frozen=True)
class Embedded:
    """A call's vectors, in the order of its inputs, and the prompt tokens they took."""

    vectors: list[list[float]]
    num_prompt_tokens: int


def embedding_models(serving: Serving) -> list[str]:
    """The names of the loaded models that embed."""
    names = []
    for name in serving.served_model_names:
        served = serving.loaded(name)
        if served is not None and served.engine.embedding is not None:
            names.append(name)
    return names


def not_an_embedding_model(serving: Serving, name: str) -> APIError:
    """400 for embeddings asked of a model that does not embed, naming those that do."""
    others = embedding_models(serving)
    there = (
        f"; the models here that do: {', '.join(repr(n) for n in others)}"
        if others
        else "; no model loaded here does (serve a sentence-transformers directory, e.g. "
        "stepline-demo-embedding)"
    )
    return APIError(
        400,
        f"the model {name!r} is not an embedding model{there}",
        param="model",
        code="model_not_embedding",
    )


def embedding_only(name: str) -> APIError:
    """400 for text generation asked of an embedding model."""
    return APIError(
        400,
        f"the model {name!r} is an embedding model: it answers /v1/embeddings and /api/embed, "
        "not text generation; send this request to a chat model",
        param="model",
        code="model_not_chat",
    )


def check_inputs(inputs: Sequence[Input], param: str) -> None:
    """Raises APIError (400) for no input, or more than `MAX_INPUTS`."""
    if not inputs:
        raise APIError(400, f"{param} must hold at least one input", param=param, code="empty")
    if len(inputs) > MAX_INPUTS:
        raise APIError(
            400,
            f"{param} holds {len(inputs)} inputs: at most {MAX_INPUTS} per request; send the "
            "rest in another",
            param=param,
            code="too_many_inputs",
        )


async def embed(
    serving: Serving,
    ctx: RequestContext[Any],
    inputs: Sequence[Input],
    *,
    param: str = "input",
    dimensions: int | None = None,
    truncate: bool = False,
    client: str | None = None,
) -> Embedded:
    """The vectors of `inputs` (texts, tokenized with the model's special tokens, or token
    ids) by the model serving `ctx`, each input a request of its own, `ctx.rid` for a lone
    one, else `<rid>-<index>`. `truncate`: an input past the context is cut to fit, not
    refused. Raises APIError: 400 for a model that does not embed, no input or too many, an
    empty one, one past the model's context, a token id outside its vocabulary, `dimensions`
    past the model's; what the engine refuses, by the catalogue."""
    engine = ctx.engine
    if engine.embedding is None:
        raise not_an_embedding_model(serving, ctx.model.name)
    check_inputs(inputs, param)
    width = getattr(getattr(engine.loaded.model, "args", None), "hidden_size", None)
    if dimensions is not None and isinstance(width, int):
        _cut([0.0] * width, dimensions, param="dimensions")  # refused before any work
    many = len(inputs) > 1
    prepared = [
        await _prepare(serving, ctx, text, f"{param}[{i}]" if many else param, truncate)
        for i, text in enumerate(inputs)
    ]
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(i: int, p: Prepared) -> list[float]:
        rid = f"{ctx.rid}-{i}" if many else ctx.rid
        async with gate:
            try:
                out = await engine.embed(p, request_id=rid, client=client)
            except Exception as exc:
                raise known_error(exc, prompt_param=param) or exc from None
        if out.embedding is None:  # cancelled (the server stopping), or an engine fault
            if out.finish_reason == "cancelled":
                raise APIError(503, "the server is shutting down", code="shutting_down")
            raise APIError(500, f"internal error (request id {rid})", code="server_error")
        return _cut(list(out.embedding), dimensions, param="dimensions")

    async with asyncio.TaskGroup() as tg:  # one input's failure cancels the others
        tasks = [tg.create_task(one(i, p)) for i, p in enumerate(prepared)]
    return Embedded([t.result() for t in tasks], sum(len(p.ids) for p in prepared))


async def _prepare(
    serving: Serving, ctx: RequestContext[Any], text: Input, param: str, truncate: bool
) -> Prepared:
    """One input's token ids, checked (an empty one, one past the context: 400 naming it)."""
    engine = ctx.engine
    prepared = await serving.prepare(ctx, prompt=text, param=param)
    n, most = len(prepared.ids), engine.max_context - 1
    if n == 0:
        raise APIError(400, f"{param} is empty: send at least one token", param=param)
    if n > most:
        if not truncate:
            raise APIError(
                400,
                f"{param} has {n} tokens, but this model embeds at most {most}: shorten it, "
                "or split it",
                param=param,
                code="context_length_exceeded",
            )
        prepared.ids[most:] = []
    return prepared


def _cut(vector: list[float], dimensions: int | None, *, param: str) -> list[float]:
    """`vector`'s first `dimensions` numbers, normalised again to unit length (a model
    trained for truncation, as Matryoshka ones are); all of it when None."""
    if dimensions is None or dimensions == len(vector):
        return vector
    if dimensions > len(vector):
        raise APIError(
            400,
            f"{param} is {dimensions}, but this model's vectors have {len(vector)} numbers: "
            f"ask for at most {len(vector)}",
            param=param,
            code="invalid_value",
        )
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]
