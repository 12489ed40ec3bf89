"""Embeddings (issue 55): an embedding request is a prompt prefilled in the same scheduler,
its vector the pooled hidden states of the model's body, the same alone, chunked under a small
step budget and in a batch; the event log records it and verifies."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DEMO = "stepline-demo-embedding"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A second, somewhat longer document about foxes, dogs and the habits of both of them.",
    "short",
    "Embeddings are the pooled hidden states of the model's body, " * 4,
]


def reference(model: Any, tokenizer: Any, text: str, pooling: str, normalize: bool) -> np.ndarray:
    """What sentence-transformers computes from the directory: the tokenizer's ids (its
    special tokens included), the transformer's last hidden states, the Pooling module's
    definition, then `Normalize` (F.normalize: over the L2 norm, at least 1e-12)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = tokenizer.encode(text)
    hidden = np.array(model.model(mx.array([ids]), cache=make_prompt_cache(model))[0])
    hidden = hidden.astype(np.float64)
    if pooling == "last":
        v = hidden[-1]
    elif pooling == "mean":
        v = hidden.mean(axis=0)
    else:
        v = hidden[0]
    return v / max(np.linalg.norm(v), 1e-12) if normalize else v


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def with_pooling(model_cache_dir: Path, tmp_path: Path, pooling: str, normalize: bool) -> Path:
    """The demo's directory, copied, with another pooling (and without `Normalize`)."""
    from stepline.engine.models import demo_model_path

    path = tmp_path / f"embed-{pooling}"
    shutil.copytree(demo_model_path(DEMO), path)
    config_file = path / "1_Pooling" / "config.json"
    config = json.loads(config_file.read_text())
    key = {"last": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}[pooling]
    for name in list(config):
        if name.startswith("pooling_mode_"):
            config[name] = name == f"pooling_mode_{key}"
    config_file.write_text(json.dumps(config))
    if not normalize:
        modules = json.loads((path / "modules.json").read_text())
        modules = [m for m in modules if not m["type"].endswith("Normalize")]
        (path / "modules.json").write_text(json.dumps(modules))
    return path


def test_the_demo_is_an_embedding_model_read_from_its_sentence_transformers_files(
    model_cache_dir: Path,
) -> None:
    from stepline.engine.models import load_model

    loaded = load_model(DEMO)
    assert loaded.embedding is not None
    assert (loaded.embedding.pooling, loaded.embedding.normalize) == ("last", True)
    assert load_model("stepline-demo").embedding is None


def test_a_pooling_stepline_does_not_compute_is_refused_at_load(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    from stepline.engine.embed import EmbeddingModelError
    from stepline.engine.models import load_model

    path = with_pooling(model_cache_dir, tmp_path, "mean", True)
    config_file = path / "1_Pooling" / "config.json"
    config = json.loads(config_file.read_text())
    config["pooling_mode_max_tokens"] = True
    config_file.write_text(json.dumps(config))
    with pytest.raises(EmbeddingModelError, match="max_tokens"):
        load_model(str(path))


@pytest.mark.parametrize(
    ("pooling", "normalize"), [("last", True), ("mean", True), ("mean", False), ("cls", True)]
)
async def test_vectors_equal_the_sentence_transformers_definition_alone_chunked_and_batched(
    model_cache_dir: Path, tmp_path: Path, pooling: str, normalize: bool
) -> None:
    from stepline.api import Engine

    model = DEMO if (pooling, normalize) == ("last", True) else None
    path = model or str(with_pooling(model_cache_dir, tmp_path, pooling, normalize))
    for budget in (512, 8):  # whole prompts; chunks of at most 8 tokens
        async with Engine.open(path, max_step_tokens=budget, max_num_seqs=4) as engine:
            refs = [
                reference(engine.loaded.model, engine.tokenizer, t, pooling, normalize)
                for t in TEXTS
            ]
            alone = [await engine.embed(t) for t in TEXTS]
            together = await asyncio.gather(*(engine.embed(t) for t in TEXTS))
        for ref, one, batched in zip(refs, alone, together, strict=True):
            for out in (one, batched):
                assert out.finish_reason == "stop"
                assert out.embedding is not None and len(out.embedding) == 64
                assert cosine(out.embedding, ref) >= 0.9999
                if not normalize:  # the scale too, not only the direction
                    assert np.allclose(out.embedding, ref, rtol=1e-3, atol=1e-4)


async def test_a_batch_of_64_gives_every_vector_it_gives_alone(model_cache_dir: Path) -> None:
    """64 inputs of different lengths sent together (batched whole prompts, padded to each
    other) each get the vector the definition gives it alone."""
    from stepline.api import Engine

    texts = [f"{TEXTS[i % len(TEXTS)]} {'and more ' * (i % 7)}{i}" for i in range(64)]
    async with Engine.open(DEMO, max_step_tokens=512, max_num_seqs=64) as engine:
        refs = [reference(engine.loaded.model, engine.tokenizer, t, "last", True) for t in texts]
        outs = await asyncio.gather(*(engine.embed(t) for t in texts))
    assert [o.finish_reason for o in outs] == ["stop"] * 64
    worst = min(cosine(o.embedding, ref) for o, ref in zip(outs, refs, strict=True))
    assert worst >= 0.9999


async def _record(log_path: Path) -> list[Any]:
    from stepline.api import Engine

    async with Engine.open(DEMO, max_step_tokens=16, max_num_seqs=4, event_log=log_path) as e:
        return await asyncio.gather(*(e.embed(t) for t in TEXTS))


def test_embedding_requests_share_steps_and_the_log_verifies(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    from helpers import replay

    from stepline.events.log import read_events

    log_path = tmp_path / "events.jsonl"
    outs = asyncio.run(_record(log_path))
    assert all(o.embedding is not None for o in outs)
    events = list(read_events(log_path))
    admitted = [ev for ev in events if ev.type == "admitted"]
    assert len(admitted) == len(TEXTS)
    assert all(ev.params.embed is not None and ev.params.max_tokens == 0 for ev in admitted)
    ends = [ev for ev in events if ev.type == "terminal"]
    assert {(ev.reason.value, ev.dimensions) for ev in ends} == {("stop", 64)}
    assert not [ev for ev in events if ev.type == "decoding"]
    plans = [ev for ev in events if ev.type == "step"]
    assert any(len(set(p.request_ids)) > 1 for p in plans)  # steps shared
    assert all(sum(p.num_tokens) <= 16 for p in plans)
    code, text = replay(str(log_path), "--verify")
    assert code == 0, text
    code, text = replay(str(log_path))  # the summary
    assert code == 0, text
    code, text = replay(str(log_path), "--request", admitted[0].request_id)
    assert code == 0 and "terminal: stop (a vector of 64)" in text, text
    # re-execution compares tokens: an embedding has none, and is skipped, saying so
    code, text = replay(str(log_path), "--reexecute", "--json")
    report = json.loads(text)
    assert report["num_skipped"] == len(TEXTS), text  # (nothing compared: not a success)


async def test_a_cancelled_embedding_ends_cancelled_and_the_engine_goes_on(
    model_cache_dir: Path,
) -> None:
    from helpers import wait_finished, wait_until

    from stepline.api import Engine
    from stepline.events.fold import Status

    async with Engine.open(DEMO, max_step_tokens=8, max_num_seqs=4) as engine:
        loop = engine.step_loop
        task = asyncio.create_task(engine.embed("word " * 400, request_id="long"))
        await wait_until(
            loop,
            lambda: (s := loop.state_of("long")) is not None and s.status is Status.PREFILLING,
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        state = await wait_finished(loop, "long")
        assert state.finish_reason is not None and state.finish_reason.value == "cancelled"
        out = await engine.embed(TEXTS[0])
        assert out.embedding is not None and out.finish_reason == "stop"


async def test_an_input_past_the_limit_is_refused_saying_how_many_tokens_an_embedding_takes(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    """No token is generated for an embedding: its refusal says how long an input may be,
    not that a prompt must leave room for a token, in the Python API and in the log."""
    from stepline.api import ContextLengthExceededError, Engine
    from stepline.events.log import read_events

    log_path = tmp_path / "events.jsonl"
    async with Engine.open(DEMO, max_step_tokens=512, event_log=log_path) as engine:
        most = engine.max_context - 1
        with pytest.raises(ContextLengthExceededError) as ids:
            await engine.embed([1] * (most + 1), request_id="ids")
        # a text whose length alone proves it too long is refused before it is tokenized
        with pytest.raises(ContextLengthExceededError) as text:
            await engine.embed("x" * (engine.max_context * engine.max_chars_per_token))
        out = await engine.embed([1] * most)  # the limit itself is embedded
        engine.step_loop.event_log.flush()
    assert str(ids.value) == (
        f"the input has {most + 1} tokens, but this model embeds at most {most}: shorten it, "
        "or split it"
    )
    assert f"has at least {engine.max_context} tokens, but this model embeds at most {most}:" in (
        str(text.value)
    )
    assert out.finish_reason == "stop" and out.embedding is not None
    (refused,) = [
        e for e in read_events(log_path) if e.type == "terminal" and e.reason.value == "rejected"
    ]
    assert refused.request_id == "ids" and refused.message == str(ids.value)


async def test_embeddings_beside_decoding_streams_leave_both_unchanged(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    """Documents embedded while greedy streams decode (their chunks in the streams' steps):
    every vector is the reference's and every stream's tokens are mlx-lm's own."""
    from helpers import mlx_lm_greedy

    from stepline.api import Engine, SamplingParams
    from stepline.events.log import read_events

    log_path = tmp_path / "events.jsonl"
    docs = [f"document number {i}: " + TEXTS[i % len(TEXTS)] for i in range(12)]
    prompts = ["Once upon a time", "The capital of France is"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with Engine.open(DEMO, max_step_tokens=16, max_num_seqs=8, event_log=log_path) as engine:
        model, tok = engine.loaded.model, engine.tokenizer
        refs = [reference(model, tok, d, "last", True) for d in docs]
        wanted = [mlx_lm_greedy(model, tok.encode(p), 24) for p in prompts]

        async def stream(prompt: str) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(prompt, params=greedy):
                tokens.extend(out.token_ids)
            return tokens

        streams = [asyncio.create_task(stream(p)) for p in prompts]
        outs = await asyncio.gather(*(engine.embed(d) for d in docs))
        got = await asyncio.gather(*streams)
    assert got == wanted
    for out, ref in zip(outs, refs, strict=True):
        assert out.embedding is not None and cosine(out.embedding, ref) >= 0.9999
    embeds = {o.request_id for o in outs}
    mixed = [
        ev
        for ev in read_events(log_path)
        if ev.type == "step"
        and "decode" in ev.kinds
        and any(
            r in embeds for r, k in zip(ev.request_ids, ev.kinds, strict=True) if k == "prefill"
        )
    ]
    assert mixed  # the documents' chunks rode in the streams' steps


def test_the_line_serve_prints_to_try_fits_what_the_model_does() -> None:
    from stepline.api.http.serve import _curl_line
    from stepline.events.models import EmbedParams

    assert "/v1/chat/completions" in _curl_line("http://h", "m", None)
    assert "/v1/embeddings" in _curl_line("http://h", "m", None, EmbedParams(pooling="last"))
    rerank = EmbedParams(pooling="last", normalize=False, head_tokens=(1, 2))
    assert "/v1/rerank" in _curl_line("http://h", "m", None, rerank)


class _FaultyBody:
    """The real model, except that its body fails on a batch of rows, and on any prompt that
    starts with the token id `POISON`."""

    POISON = 5

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    @property
    def model(self) -> Any:
        body = self._model.model

        def run(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if inputs.shape[0] > 1:
                raise RuntimeError("injected batch fault")
            if int(inputs[0, 0].item()) == self.POISON and kwargs.get("cache") is not None:
                if all(c.offset == 0 for c in kwargs["cache"]):
                    raise RuntimeError("injected prompt fault")
            return body(inputs, *args, **kwargs)

        return run


async def test_a_failed_batch_runs_each_alone_and_a_faulty_prompt_fails_only_itself(
    model_cache_dir: Path,
) -> None:
    from stepline.api import Engine

    async with Engine.open(DEMO, max_step_tokens=512, max_num_seqs=8) as engine:
        runner = engine.step_loop.runner
        real = runner.model
        runner.model = _FaultyBody(real)
        poisoned = [_FaultyBody.POISON, *engine.tokenizer.encode(TEXTS[0])]
        outs = await asyncio.gather(*(engine.embed(t) for t in [*TEXTS, poisoned]))
        runner.model = real
        refs = [reference(real, engine.tokenizer, t, "last", True) for t in TEXTS]
        for out, ref in zip(outs, refs, strict=False):
            assert out.finish_reason == "stop" and cosine(out.embedding, ref) >= 0.9999
        assert outs[-1].finish_reason == "error" and outs[-1].embedding is None
        assert engine.healthy
