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


def is_embedder(engine: Any) -> bool:
    """Whether the model makes embeddings (a reranker's results are scores)."""
    spec = engine.embedding
    return spec is not None and not spec.head_tokens


def is_reranker(engine: Any) -> bool:
    """Whether the model scores documents for a query (`engine.embed.read_reranker`)."""
    spec = engine.embedding
    return spec is not None and bool(spec.head_tokens)


def models_that(serving: Serving, does: Any) -> list[str]:
    """The names of the loaded models whose engine `does` (`is_embedder`, `is_reranker`)."""
    names = []
    for name in serving.served_model_names:
        served = serving.loaded(name)
        if served is not None and does(served.engine):
            names.append(name)
    return names


def not_an_embedding_model(serving: Serving, name: str, *, rerank: bool = False) -> APIError:
    """400 for embeddings (`rerank`: scores) asked of a model that does not make them,
    naming the loaded models that do."""
    others = models_that(serving, is_reranker if rerank else is_embedder)
    kind, demo = ("a reranker", "stepline-demo-reranker") if rerank else ("an embedding model", "")
    example = demo or "a sentence-transformers directory, e.g. stepline-demo-embedding"
    there = (
        f"; the models here that are: {', '.join(repr(n) for n in others)}"
        if others
        else f"; no model loaded here is (serve {example})"
    )
    return APIError(
        400,
        f"the model {name!r} is not {kind}{there}",
        param="model",
        code="model_not_reranker" if rerank else "model_not_embedding",
    )


def embedding_only(name: str) -> APIError:
    """400 for text generation asked of an embedding model (or a reranker)."""
    return APIError(
        400,
        f"the model {name!r} is an embedding model or a reranker: it answers "
        "/v1/embeddings and /api/embed, or /v1/rerank, not text generation; send this "
        "request to a chat model",
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
    if not is_embedder(engine):
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
    vectors = await run_all(ctx, prepared, param=param, client=client)
    cut = [_cut(v, dimensions, param="dimensions") for v in vectors]
    return Embedded(cut, sum(len(p.ids) for p in prepared))


async def run_all(
    ctx: RequestContext[Any],
    prepared: Sequence[Prepared],
    *,
    param: str,
    client: str | None,
    checkpoints: Sequence[int] = (),
) -> list[list[float]]:
    """Each prepared input's vector, every input a request of its own (`ctx.rid` for a lone
    one, else `<rid>-<index>`), submitted together (at most `MAX_IN_FLIGHT` at once);
    `checkpoints`: where their shared prefix ends. One's failure cancels the others."""
    engine, many = ctx.engine, len(prepared) > 1
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(i: int, p: Prepared) -> list[float]:
        rid = f"{ctx.rid}-{i}" if many else ctx.rid
        async with gate:
            try:
                out = await engine.embed(
                    p,
                    request_id=rid,
                    client=client,
                    checkpoints=checkpoints,
                    door=ctx.request.url.path,
                )
            except Exception as exc:
                raise known_error(exc, prompt_param=param) or exc from None
        if out.embedding is None:  # cancelled (the server stopping), or an engine fault
            if out.finish_reason == "cancelled":
                raise APIError(503, "the server is shutting down", code="shutting_down")
            raise APIError(500, f"internal error (request id {rid})", code="server_error")
        return list(out.embedding)

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(i, p)) for i, p in enumerate(prepared)]
    except ExceptionGroup as group:  # the first failure is the call's answer
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def _prepare(
    serving: Serving, ctx: RequestContext[Any], text: Input, param: str, truncate: bool
) -> Prepared:
    """One input's token ids, checked (an empty one, one past the context: 400 naming it).
    A text cut to fit (`truncate`) by a model whose prompt goes whole (a BERT-family encoder)
    is cut as its tokenizer and sentence-transformers cut it: its text, keeping the special
    tokens around it."""
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
        spec = engine.embedding
        if isinstance(text, str) and spec is not None and spec.whole:
            hf = getattr(engine.loaded.tokenizer, "_tokenizer", engine.loaded.tokenizer)
            prepared.ids[:] = hf(text, truncation=True, max_length=most)["input_ids"]
        else:
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
