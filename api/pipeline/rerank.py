"""Rerank (`/v1/rerank`, `/rerank`, in the Cohere / Jina shape): a query's documents scored
by a Qwen3-Reranker-style model, each document a prefill-only request of its own (as an
embedding is, `api/pipeline/embed.py`) whose result is the model's logits of "no" and "yes" at
its last token; its score is the probability of "yes" between the two.

Each document's prompt is Qwen3-Reranker's: its judging system prompt, then
`<Instruct>: ...\\n<Query>: ...\\n<Document>: ...`, then the assistant's turn with an empty
think block. The part before the document is the same for every document of a call: its end
is a checkpoint, so the prefix cache computes it once and the other documents start there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stepline.api.pipeline.embed import check_inputs, is_reranker, not_an_embedding_model, run_all
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.served import RequestContext

if TYPE_CHECKING:
    from stepline.api.pipeline.serving import Serving

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class Scored:
    """A call's scores, in the order of its documents, and the prompt tokens they took."""

    scores: list[float]
    num_prompt_tokens: int


def prompt_pieces(instruction: str, query: str, document: str) -> tuple[str, str]:
    """A document's prompt as two texts: what every document of the query shares, and the
    rest. The document's text starts the second with the space the template puts before it,
    as a whole prompt's tokenizer would split it."""
    shared = f"{PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>:"
    return shared, f" {document}{SUFFIX}"


async def rerank(
    serving: Serving,
    ctx: RequestContext[Any],
    query: str,
    documents: Sequence[str],
    *,
    instruction: str | None = None,
    client: str | None = None,
) -> Scored:
    """Each of `documents`' relevance to `query` (0 to 1) by the model serving `ctx`. Raises
    APIError: 400 for a model that is not a reranker, an empty query, no document or too
    many, one past the model's context."""
    engine = ctx.engine
    if not is_reranker(engine):
        raise not_an_embedding_model(serving, ctx.model.name, rerank=True)
    if not query:
        raise APIError(400, "query must not be empty", param="query", code="empty")
    check_inputs(documents, "documents")
    encode = engine.tokenizer.encode
    shared_text, _ = prompt_pieces(instruction or DEFAULT_INSTRUCTION, query, "")
    shared = list(encode(shared_text, add_special_tokens=False))
    most = engine.max_context - 1
    prepared = []
    for i, doc in enumerate(documents):
        _, rest = prompt_pieces(instruction or DEFAULT_INSTRUCTION, query, doc)
        ids = shared + list(encode(rest, add_special_tokens=False))
        if len(ids) > most:
            raise APIError(
                400,
                f"documents[{i}] with the query takes {len(ids)} tokens, but this model reads "
                f"at most {most}: shorten it, or split it",
                param=f"documents[{i}]",
                code="context_length_exceeded",
            )
        prepared.append(await serving.prepare(ctx, prompt=ids, param=f"documents[{i}]"))
    logits = await run_all(
        ctx, prepared, param="documents", client=client, checkpoints=(len(shared),)
    )
    scores = [_yes(no, yes) for no, yes in logits]
    return Scored(scores, sum(len(p.ids) for p in prepared))


def _yes(no: float, yes: float) -> float:
    """The probability of "yes" between the two answers (softmax over their logits; tanh:
    no overflow however far apart they are)."""
    return 0.5 * (1.0 + math.tanh((yes - no) / 2.0))
