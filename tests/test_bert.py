"""BERT-family sentence-transformers models as embedding models (issue 55, the `bert` extra):
a random-weight BERT and XLM-RoBERTa built offline (tests/bert_files.py) served through the
real HTTP doors, their vectors what sentence-transformers computes from the directory (the
encoder's hidden states, pooled over each input's own tokens, normalised), alone or batched;
each input one atomic chunk in the scheduler, deferred to a step that holds it whole; inputs
past the model's limit refused or cut as the tokenizer cuts; served beside a chat model."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from bert_files import build_bert_dir
from core_driver import make_core, params
from helpers import Served, hold_open, open_served, replay
from test_embed_scheduling import embedded

from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.log import read_events
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    EmbedParams,
    FinishReason,
    StepPlanned,
    Terminal,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A second, somewhat longer document about foxes, dogs and the habits of both of them.",
    "short",
    "Embeddings are the pooled hidden states of the encoder",
]
WHOLE = params(max_tokens=0, embed=EmbedParams(pooling="mean", whole=True))


def reference(path: Path, text: str) -> np.ndarray:
    """sentence-transformers' definition, from the directory's own files: the tokenizer's
    ids (special tokens included), mlx-embeddings' encoder over that one input unpadded, the
    Pooling config's mode over its tokens, then Normalize (F.normalize: over the L2 norm, at
    least 1e-12) where modules.json lists it. In numpy, float64."""
    import mlx.core as mx
    from mlx_embeddings.utils import load_model
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(path))(text)["input_ids"]
    hidden = load_model(path)(mx.array([ids])).last_hidden_state
    h = np.array(hidden[0]).astype(np.float64)
    pool = json.loads((path / "1_Pooling" / "config.json").read_text())
    if pool["pooling_mode_mean_tokens"]:
        v = h.mean(axis=0)
    elif pool["pooling_mode_cls_token"]:
        v = h[0]
    else:
        v = h[-1]
    modules = json.loads((path / "modules.json").read_text())
    if any(m["type"].endswith("Normalize") for m in modules):
        v = v / max(np.linalg.norm(v), 1e-12)
    return v


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT, mean-pooled and normalised, 64 positions, inputs of at most 48 tokens
    (its sentence_bert_config.json's max_seq_length, as sentence-transformers cuts)."""
    out = tmp_path_factory.mktemp("bert") / "tiny-bert"
    return build_bert_dir(out, pooling="mean", max_seq_length=48)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    bert_dir: Path, model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    """The BERT behind a real server, 24-token steps: several inputs share a step, a longer
    one waits for a step of its own, none is ever split."""
    log = tmp_path_factory.mktemp("bert-log") / "events.jsonl"
    value, close = await hold_open(
        open_served(str(bert_dir), engine={"max_step_tokens": 24, "max_num_seqs": 4}, event_log=log)
    )
    try:
        yield value
    finally:
        await close()


in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the server fixture's loop


@in_module_loop
async def test_the_openai_client_embeds_a_batch_equal_to_sentence_transformers(
    served: Served, bert_dir: Path
) -> None:
    from mlx_embeddings.utils import load_model

    async with served.client() as client:
        got = await client.embeddings.create(model=str(bert_dir), input=TEXTS)
        one = await client.embeddings.create(model=str(bert_dir), input=TEXTS[1])
    refs = [reference(bert_dir, t) for t in TEXTS]
    assert [len(d.embedding) for d in got.data] == [32] * len(TEXTS)
    for d, ref in zip(got.data, refs, strict=True):
        assert cosine(d.embedding, ref) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    assert cosine(one.data[0].embedding, refs[1]) >= 0.9999
    # mlx-embeddings' own mean-pooled, normalised vector of the same input agrees
    import mlx.core as mx

    ids = served.engine.tokenizer.encode(TEXTS[0])
    own = load_model(bert_dir)(mx.array([ids])).text_embeds[0]
    assert cosine(got.data[0].embedding, np.array(own)) >= 0.9999
    assert got.usage.prompt_tokens == sum(len(served.engine.tokenizer.encode(t)) for t in TEXTS)


@in_module_loop
async def test_each_input_is_one_chunk_and_the_log_verifies(served: Served) -> None:
    """24-token steps: an input is never split, and one that does not fit beside the step's
    others waits for a step that holds it whole (the plan says it was held for the budget)."""
    docs = [f"{i} " + TEXTS[i % len(TEXTS)][: 12 + 4 * i] for i in range(12)]
    async with served.http() as http:
        r = await http.post("/v1/embeddings", json={"input": docs})
    assert r.status_code == 200, r.text
    assert served.event_log is not None
    served.engine.step_loop.event_log.flush()
    events = list(read_events(served.event_log))
    admitted = [e for e in events if isinstance(e, Admitted)]
    assert all(e.params.embed is not None and e.params.embed.whole for e in admitted)
    lengths = {e.request_id: e.num_prompt_tokens for e in admitted}
    assert max(lengths.values()) > 24  # one that no step holds: it ran alone
    chunks = [(e.request_id, e.start, e.end) for e in events if isinstance(e, ChunkPrefilled)]
    assert sorted(chunks) == sorted((rid, 0, n) for rid, n in lengths.items())  # one each, whole
    terminals = [e for e in events if isinstance(e, Terminal) and e.request_id in lengths]
    assert {t.dimensions for t in terminals} == {32}
    plans = [e for e in events if isinstance(e, StepPlanned)]
    assert "budget" in {reason for e in plans for reason in e.held_reasons}
    assert any(len(e.request_ids) > 1 for e in plans)  # inputs share steps
    code, text = replay(str(served.event_log), "--verify")
    assert code == 0, text


@in_module_loop
async def test_an_input_past_the_limit_is_a_400_naming_it_unless_truncated(
    served: Served, bert_dir: Path
) -> None:
    from transformers import AutoTokenizer

    long = "fox " * 80
    async with served.http() as http:
        r = await http.post("/v1/embeddings", json={"input": ["fine", long]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "input[1]" and "at most 48" in error["message"]
        r = await http.post(
            "/api/embed", json={"model": served.engine.model_name, "input": long}
        )  # truncates
        assert r.status_code == 200, r.text
        r48 = await http.post("/v1/embeddings", json={"input": long[: 4 * 46]})
    # cut as the tokenizer cuts (and sentence-transformers): its text, then [SEP]
    hf = AutoTokenizer.from_pretrained(str(bert_dir))
    assert hf(long, truncation=True, max_length=48)["input_ids"] == hf(long[: 4 * 46])["input_ids"]
    assert cosine(r.json()["embeddings"][0], r48.json()["data"][0]["embedding"]) >= 0.9999


@in_module_loop
async def test_chat_asked_of_a_bert_model_is_a_400(served: Served) -> None:
    async with served.http() as http:
        r = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat"


@in_module_loop
@pytest.mark.parametrize(
    ("model_type", "pooling", "normalize"),
    [("bert", "cls", True), ("bert", "last", False), ("xlm-roberta", "mean", True)],
)
async def test_every_pooling_and_xlm_roberta_give_the_reference_alone_and_batched(
    model_cache_dir: Path, tmp_path: Path, model_type: str, pooling: str, normalize: bool
) -> None:
    path = build_bert_dir(
        tmp_path / model_type, model_type=model_type, pooling=pooling, normalize=normalize
    )
    async with open_served(str(path), engine={"max_step_tokens": 64}) as s, s.http() as http:
        r = await http.post("/v1/embeddings", json={"input": TEXTS})
        alone = await http.post("/v1/embeddings", json={"input": TEXTS[2]})
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], TEXTS, strict=True):
        assert cosine(d["embedding"], reference(path, text)) >= 0.9999
    assert cosine(alone.json()["data"][0]["embedding"], reference(path, TEXTS[2])) >= 0.9999
    if not normalize:  # the raw pooled state, not a unit vector
        assert abs(np.linalg.norm(r.json()["data"][0]["embedding"]) - 1) > 1e-3


@in_module_loop
async def test_one_server_serves_a_bert_model_beside_a_chat_model(
    bert_dir: Path, model_cache_dir: Path, tmp_path: Path
) -> None:
    """`--model emb=DIR --model chat=stepline-demo`: one event log that verifies."""
    import httpx

    from stepline.api.config import EventLogConfig, ModelSpec, PoolConfig
    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pool import ModelPool

    log = tmp_path / "events.jsonl"
    config = PoolConfig(
        models=(
            ModelSpec.model_validate({"name": "emb", "model": str(bert_dir)}),
            ModelSpec.model_validate({"name": "chat", "model": "stepline-demo"}),
        )
    )
    small = {"max_kv_gb": 0.01, "prefix_cache_gb": 0.01, "max_step_ms": 0, "max_step_tokens": 64}
    async with (
        ModelPool.open(config, small, EventLogConfig(event_log=str(log))) as models,
        serve_in_process(create_app(models)) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        r = await http.post("/v1/embeddings", json={"model": "emb", "input": TEXTS})
        assert r.status_code == 200, r.text
        for d, text in zip(r.json()["data"], TEXTS, strict=True):
            assert cosine(d["embedding"], reference(bert_dir, text)) >= 0.9999
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        r = await http.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
        assert r.status_code == 400 and "'emb'" in r.json()["error"]["message"]
        cards = {
            c["id"]: c.get("capabilities") for c in (await http.get("/v1/models")).json()["data"]
        }
    assert cards == {"emb": ["embeddings"], "chat": ["chat", "completions"]}
    code, text = replay(str(log), "--verify")
    assert code == 0, text


def test_without_the_extra_loading_says_to_install_it(
    bert_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepline.engine.bert import ExtraMissingError
    from stepline.engine.models import load_model

    monkeypatch.setitem(sys.modules, "mlx_embeddings.utils", None)  # import fails
    with pytest.raises(ExtraMissingError, match=r"install stepline\[bert\]"):
        load_model(str(bert_dir))


def test_a_bert_directory_without_sentence_transformers_files_is_refused(
    bert_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from stepline.engine.embed import EmbeddingModelError
    from stepline.engine.models import load_model

    plain = tmp_path / "plain-bert"
    shutil.copytree(bert_dir, plain)
    (plain / "modules.json").unlink()
    with pytest.raises(EmbeddingModelError, match="sentence-transformers files"):
        load_model(str(plain))


# -- the scheduler: an atomic prompt (no model) ----------------------------------------------


def test_a_whole_prompt_waits_for_a_step_that_holds_it_rather_than_being_split():
    core = make_core(config=SchedulerConfig(max_step_tokens=16, max_num_seqs=8))
    core.add("a", tuple(range(3, 13)), WHOLE)  # 10 tokens
    core.add("b", tuple(range(3, 13)), WHOLE)  # 10 more: not in the 6 left
    core.add("c", tuple(range(3, 7)), WHOLE)  # 4: fits beside a
    work = core.schedule()
    assert sorted((c.request_id, c.start, c.end) for c in work.plan.chunks) == [
        ("a", 0, 10),
        ("c", 0, 4),
    ]
    assert dict(work.plan.held)["b"] == "budget"
    core.update_from_output(work, embedded(work))
    assert [(c.request_id, c.start, c.end) for c in core.schedule().plan.chunks] == [("b", 0, 10)]


def test_a_whole_prompt_longer_than_any_step_runs_alone():
    core = make_core(config=SchedulerConfig(max_step_tokens=16, max_num_seqs=8))
    core.add("long", tuple(range(3, 43)), WHOLE)  # 40 tokens: no step of 16 holds it
    core.add("short", (3, 4, 5), WHOLE)
    steps = []
    while (work := core.schedule()) is not None:
        steps.append([(c.request_id, c.start, c.end) for c in work.plan.chunks])
        core.update_from_output(work, embedded(work))
    assert steps == [[("short", 0, 3)], [("long", 0, 40)]]


def _whole_log(path: Path, chunks: list[tuple[int, int]]) -> Path:
    """A log of one 12-token BERT input under 8-token steps, prefilled in `chunks`."""
    from log_builder import LogBuilder

    b = LogBuilder(max_step_tokens=8)
    b.admit("a", 12, params=WHOLE)
    for start, end in chunks:
        b.plan(("a", "prefill", end - start))
        b.chunk("a", start, end)
    b._add(Terminal, request_id="a", reason=FinishReason.STOP, dimensions=32)
    return b.write(path)


def test_replay_verify_flags_a_whole_prompt_split_and_passes_one_run_alone(tmp_path: Path):
    from stepline.events.replay import ViolationKind, verify

    assert verify(_whole_log(tmp_path / "alone.jsonl", [(0, 12)])).ok  # alone, past the budget
    split = verify(_whole_log(tmp_path / "split.jsonl", [(0, 8), (8, 12)]))
    assert ViolationKind.CHUNK_SPLITS_PROMPT in {v.kind for v in split.violations}


def test_a_fault_in_one_input_ends_that_request_alone(bert_dir: Path) -> None:
    """A batch whose forward fails is run again input by input: the input that fails ends
    with an error, the others of its batch get their vectors."""
    from stepline.actors.scheduler.plan import ScheduledChunk, StepPlan
    from stepline.actors.scheduler.work import PREFILL_FAILED, NewRequest, StepWork
    from stepline.engine.bert import EncoderRunner
    from stepline.engine.models import load_model

    runner = EncoderRunner(load_model(str(bert_dir)))
    real = runner.model.hidden
    poison = 7  # a token id only the faulty input holds

    def hidden(ids: Any, mask: Any) -> Any:
        if any(poison in row for row in ids.tolist()):  # its batch, and it alone
            raise RuntimeError("a fault of this input")
        return real(ids, mask)

    runner.model.hidden = hidden  # type: ignore[method-assign]
    prompts = {"good": (2, 10, 11, 12, 3), "bad": (2, poison, 11, 3), "also": (2, 13, 3)}
    work = StepWork(
        plan=StepPlan(
            step=1,
            chunks=tuple(ScheduledChunk(r, 0, len(p), (), True) for r, p in prompts.items()),
        ),
        admit=tuple(NewRequest(r, p, WHOLE) for r, p in prompts.items()),
    )
    result = runner.run(work)
    assert dict(result.failed) == {"bad": PREFILL_FAILED}
    assert set(result.embeddings) == {"good", "also"}
    assert runner.num_sequences == 2  # the faulty one is freed; the others until their free
