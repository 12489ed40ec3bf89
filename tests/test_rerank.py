"""Rerank (issue 55): /v1/rerank and /rerank score a query's documents by a
Qwen3-Reranker-style model's "no"/"yes" logits at the last token, each document a
prefill-only request; the query's part of the prompt is computed once (the prefix cache)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from helpers import Served, hold_open, open_served, replay

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEMO = "stepline-demo-reranker"
QUERY = "What do foxes eat?"
DOCS = [
    "Foxes eat small rodents, birds, insects and fruit.",
    "The stock market closed higher on Tuesday.",
    "A fox is an omnivore: it eats what it finds, from mice to berries.",
    "short",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reranker(
    model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    log = tmp_path_factory.mktemp("rerank") / "events.jsonl"
    value, close = await hold_open(
        open_served(DEMO, engine={"max_step_tokens": 32, "max_num_seqs": 4}, event_log=log)
    )
    try:
        yield value
    finally:
        await close()


def reference(served: Served, query: str, doc: str) -> float:
    """Qwen3-Reranker's own recipe: its prefix and suffix tokens around the pair's, the full
    model's logits at the last position, "yes" against "no"."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from stepline.api.pipeline.rerank import DEFAULT_INSTRUCTION, PREFIX, SUFFIX

    engine = served.engine
    tok = engine.tokenizer
    body = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
    ids = (
        tok.encode(PREFIX, add_special_tokens=False)
        + tok.encode(body, add_special_tokens=False)
        + tok.encode(SUFFIX, add_special_tokens=False)
    )
    model = engine.loaded.model
    logits = model(mx.array([ids]), cache=make_prompt_cache(model))[0, -1]
    no, yes = engine.embedding.head_tokens
    pair = [float(logits[no]), float(logits[yes])]
    top = max(pair)
    return math.exp(pair[1] - top) / sum(math.exp(x - top) for x in pair)


async def test_scores_equal_the_rerankers_own_recipe_sorted(reranker: Served) -> None:
    refs = [reference(reranker, QUERY, d) for d in DOCS]
    async with reranker.http() as http:
        r = await http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    for x in results:
        assert abs(x["relevance_score"] - refs[x["index"]]) < 1e-4
        assert "document" not in x
    assert body["usage"]["total_tokens"] > 0


async def test_top_n_documents_as_objects_and_the_root_path(reranker: Served) -> None:
    docs = [{"text": d} for d in DOCS]
    for path in ("/rerank", "/v2/rerank"):  # the root path, and Cohere's
        async with reranker.http() as http:
            r = await http.post(
                path,
                json={"query": QUERY, "documents": docs, "top_n": 2, "return_documents": True},
            )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2
        assert all(x["document"]["text"] == DOCS[x["index"]] for x in results)


async def test_the_query_is_computed_once_and_the_log_verifies(reranker: Served) -> None:
    from stepline.api.pipeline.rerank import DEFAULT_INSTRUCTION, prompt_pieces
    from stepline.events.log import read_events

    query = "Why do dogs bark at night?"
    shared, _ = prompt_pieces(DEFAULT_INSTRUCTION, query, "")
    num_shared = len(reranker.engine.tokenizer.encode(shared, add_special_tokens=False))
    async with reranker.http() as http:
        r = await http.post("/v1/rerank", json={"query": query, "documents": DOCS})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    log = reranker.flushed_log()
    firsts = {}
    for ev in read_events(log):
        if ev.type == "chunk-prefilled" and ev.request_id.startswith(rid):
            firsts.setdefault(ev.request_id, ev)
    assert len(firsts) == len(DOCS)
    # the first computes the query's part (from the system prompt an earlier call left),
    # the others start where it ends
    cached = sorted(ev.num_cached_tokens for ev in firsts.values())
    assert 0 < cached[0] < num_shared and cached[1:] == [num_shared] * (len(DOCS) - 1)
    code, text = replay(str(log), "--verify")
    assert code == 0, text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": "", "documents": DOCS}, "query"),
        ({"query": QUERY, "documents": ["word " * 3000]}, "documents[0]"),
        ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ],
)
async def test_bad_rerank_input_is_a_400_naming_it(
    reranker: Served, body: dict[str, Any], param: str
) -> None:
    async with reranker.http() as http:
        r = await http.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_a_reranker_neither_embeds_nor_chats_and_says_what_it_does(
    reranker: Served,
) -> None:
    async with reranker.http() as http:
        r = await http.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
        r = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat"
        cards = (await http.get("/v1/models")).json()["data"]
    assert cards[0]["capabilities"] == ["rerank"]


async def test_rerank_asked_of_a_chat_model_is_a_400(model_cache_dir: Path) -> None:
    async with open_served("stepline-demo") as chat, chat.http() as http:
        r = await http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_reranker"
