"""The embedding doors (issue 55): OpenAI's /v1/embeddings and Ollama's /api/embed and
/api/embeddings on a real server, with the official clients; their bad inputs; chat refused
by an embedding model and embeddings by a chat model."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from helpers import Served, hold_open, open_served, replay
from test_embeddings import TEXTS, cosine, reference

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEMO = "stepline-demo-embedding"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedder(
    model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    """The embedding demo behind a real server, 8-token steps (every text is chunked)."""
    log = tmp_path_factory.mktemp("embed") / "events.jsonl"
    value, close = await hold_open(
        open_served(DEMO, engine={"max_step_tokens": 8, "max_num_seqs": 4}, event_log=log)
    )
    try:
        yield value
    finally:
        await close()


def refs(served: Served) -> list[np.ndarray]:
    engine = served.engine
    return [reference(engine.loaded.model, engine.tokenizer, t, "last", True) for t in TEXTS]


async def test_the_openai_client_embeds_a_batch_equal_to_the_reference(embedder: Served) -> None:
    async with embedder.client() as client:
        got = await client.embeddings.create(model=DEMO, input=TEXTS)  # the SDK asks base64
        one = await client.embeddings.create(model=DEMO, input=TEXTS[0], encoding_format="float")
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for d, ref in zip(got.data, refs(embedder), strict=True):
        assert len(d.embedding) == 64
        assert cosine(d.embedding, ref) >= 0.9999
    ids = [embedder.engine.tokenizer.encode(t) for t in TEXTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    assert cosine(one.data[0].embedding, got.data[0].embedding) >= 0.9999


async def test_a_batch_of_64_gives_each_input_its_own_vector(embedder: Served) -> None:
    engine = embedder.engine
    docs = [f"{i}: " + TEXTS[i % len(TEXTS)][: 10 + i] for i in range(64)]
    async with embedder.http() as http:
        r = await http.post("/v1/embeddings", json={"input": docs})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    for d, doc in zip(data, docs, strict=True):
        ref = reference(engine.loaded.model, engine.tokenizer, doc, "last", True)
        assert cosine(d["embedding"], ref) >= 0.9999


async def test_token_ids_base64_and_dimensions(embedder: Served) -> None:
    ids = embedder.engine.tokenizer.encode(TEXTS[1])
    ref = refs(embedder)[1]
    async with embedder.http() as http:
        r = await http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert cosine(struct.unpack(f"<{len(raw) // 4}f", raw), ref) >= 0.9999
        r = await http.post("/v1/embeddings", json={"input": [ids, ids[:5]]})
        assert [len(d["embedding"]) for d in r.json()["data"]] == [64, 64]
        r = await http.post("/v1/embeddings", json={"input": TEXTS[1], "dimensions": 16})
        cut = np.array(r.json()["data"][0]["embedding"])
        assert cut.shape == (16,) and abs(np.linalg.norm(cut) - 1) < 1e-5
        assert cosine(cut, ref[:16]) >= 0.9999


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "at least one"),
        ({"input": ""}, "input", "empty"),
        ({"input": ["a"] * 2049}, "input", "at most 2048"),
        ({"input": "word " * 3000}, "input", "at most 2047"),
        ({"input": ["fine", "word " * 3000]}, "input[1]", "at most 2047"),
        ({"input": [[1, 2, 10**6]]}, "input", "vocabulary"),
        ({"input": "x", "dimensions": 65}, "dimensions", "at most 64"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ],
)
async def test_bad_input_is_a_400_naming_it(
    embedder: Served, body: dict[str, Any], param: str, words: str
) -> None:
    async with embedder.http() as http:
        r = await http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


async def test_chat_asked_of_an_embedding_model_is_a_400(embedder: Served) -> None:
    async with embedder.http() as http:
        r = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat"
        r = await http.post("/api/generate", json={"model": DEMO, "prompt": "hi", "stream": False})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]


async def test_models_say_what_each_model_does(embedder: Served) -> None:
    async with embedder.http() as http:
        cards = (await http.get("/v1/models")).json()["data"]
        tags = (await http.get("/api/tags")).json()["models"]
    assert cards[0]["capabilities"] == ["embeddings"]
    assert tags[0]["capabilities"] == ["embedding"]


async def test_the_ollama_client_embeds(embedder: Served) -> None:
    import ollama

    async with ollama.AsyncClient(host=embedder.url) as client:
        got = await client.embed(model=DEMO, input=TEXTS[:2])
        legacy = await client.embeddings(model=DEMO, prompt=TEXTS[0])
    for vector, ref in zip(got.embeddings, refs(embedder)[:2], strict=True):
        assert cosine(vector, ref) >= 0.9999
    assert got.prompt_eval_count == sum(len(embedder.engine.tokenizer.encode(t)) for t in TEXTS[:2])
    assert cosine(legacy.embedding, refs(embedder)[0]) >= 0.9999
    async with embedder.http() as http:  # Ollama truncates by default, refuses on false
        long = {"model": DEMO, "input": "word " * 3000}
        assert (await http.post("/api/embed", json=long)).status_code == 200
        r = await http.post("/api/embed", json={**long, "truncate": False})
        assert r.status_code == 400 and "at most 2047" in r.json()["error"]


async def test_the_log_verifies_after_the_calls(embedder: Served) -> None:
    code, text = replay(str(embedder.flushed_log()), "--verify")
    assert code == 0, text


async def test_embeddings_asked_of_a_chat_model_name_the_models_that_embed(
    model_cache_dir: Path,
) -> None:
    async with open_served("stepline-demo") as chat, chat.http() as http:
        r = await http.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "model_not_embedding"
        assert "not an embedding model" in r.json()["error"]["message"]
        r = await http.post("/api/embed", json={"model": "stepline-demo", "input": "hi"})
        assert r.status_code == 400 and "not an embedding model" in r.json()["error"]


async def test_langchain_openai_embeddings_work_unchanged(embedder: Served) -> None:
    import httpx
    from langchain_openai import OpenAIEmbeddings

    async with httpx.AsyncClient() as http:  # closed here, in this test's loop
        # Its default counts tokens with tiktoken (OpenAI's vocabulary, downloaded): text here.
        lc = OpenAIEmbeddings(
            model=DEMO,
            base_url=f"{embedder.url}/v1",
            api_key="sk-one",  # type: ignore[arg-type]
            check_embedding_ctx_length=False,
            max_retries=0,
            http_async_client=http,
        )
        docs = await lc.aembed_documents(TEXTS)
        query = await lc.aembed_query(TEXTS[0])
    for vector, ref in zip(docs, refs(embedder), strict=True):
        assert cosine(vector, ref) >= 0.9999
    assert cosine(query, docs[0]) >= 0.9999


async def test_one_server_serves_an_embedding_model_beside_a_chat_model(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    """`--model emb=... --model chat=...`: each door to its model, the refusals naming the
    other, one event log that verifies."""
    from stepline.api.config import EventLogConfig, ModelSpec, PoolConfig
    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pool import ModelPool

    log = tmp_path / "events.jsonl"
    config = PoolConfig(
        models=(
            ModelSpec.model_validate({"name": "emb", "model": DEMO}),
            ModelSpec.model_validate({"name": "chat", "model": "stepline-demo"}),
        )
    )
    small = {"max_kv_gb": 0.01, "prefix_cache_gb": 0.01, "max_step_ms": 0, "max_step_tokens": 64}
    async with (
        ModelPool.open(config, small, EventLogConfig(event_log=str(log))) as models,
        serve_in_process(create_app(models)) as url,
        httpx_client(url) as http,
    ):
        r = await http.post("/v1/embeddings", json={"model": "emb", "input": TEXTS})
        assert r.status_code == 200 and len(r.json()["data"]) == len(TEXTS)
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        r = await http.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
        assert r.status_code == 400 and "'emb'" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json={**chat, "model": "emb"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat"
        cards = {
            c["id"]: c.get("capabilities") for c in (await http.get("/v1/models")).json()["data"]
        }
    assert cards == {"emb": ["embeddings"], "chat": ["chat", "completions"]}
    code, text = replay(str(log), "--verify")
    assert code == 0, text


def httpx_client(url: str) -> Any:
    import httpx

    return httpx.AsyncClient(base_url=url, timeout=60)
