"""Every family's fast paths, proven on its own loaded model: the head split from the body
gives the full model's logits (a wrapper's, a soft-capped, a scaled head, a body at
`backbone`), the table in docs/models.md says what those proofs say, and greedy tokens
through the engine are mlx-lm's own for a wrapped, a wrapped hybrid and a soft-capped
model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from families import DOCS, FAMILIES, Family, build, docs_table, model_dir, table
from helpers import mlx_lm_greedy
from mlx_lm.models.cache import make_prompt_cache

from stepline.api import Engine, SamplingParams
from stepline.engine.forward import body_of, forward, output_head, split_head_works, text_model
from stepline.engine.models import load_model

BY_MODULE = {f.module: f for f in reversed(FAMILIES)}  # each module's first family


def test_the_docs_table_says_what_each_familys_own_proofs_say():
    assert docs_table(DOCS.read_text(encoding="utf-8")) == table(), (
        "docs/models.md's table of families is stale: run `python tests/families.py --write`"
    )


@pytest.mark.parametrize("family", FAMILIES, ids=[f.module + "-" + f.name for f in FAMILIES])
def test_every_familys_split_head_gives_its_full_logits_and_cache(family: Family):
    """A chunk that continues a prompt, through the body and the head apart, gives the
    logits of the whole model's forward at its last position, and leaves the cache where
    the whole model leaves it."""
    model = build(family)
    assert split_head_works(model)
    prompt, chunk = mx.array([[5, 9, 2, 7, 11, 3]]), mx.array([[4, 8, 6, 10, 12]])
    split, full = make_prompt_cache(model), make_prompt_cache(model)
    for cache in (split, full):
        model(prompt, cache=cache)
    got = forward(model, chunk, split, logits=True, split=True)
    want = model(chunk, cache=full)[:, -1, :]
    assert got is not None and got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4)
    nxt = mx.array([[13]])
    assert mx.allclose(model(nxt, cache=split), model(nxt, cache=full), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("module", ["gemma2", "gemma4_text", "gemma4", "granite", "cohere"])
def test_the_test_models_cap_and_scale_their_logits_past_the_proofs_tolerance(module: str):
    """A head that forgot the soft-capping or the scaling would not be taken for the
    model's: its raw projection is far from the model's logits, the whole head's is not."""
    model = build(BY_MODULE[module])
    tokens = mx.array([[5, 9, 2, 7]])
    hidden = body_of(model)(tokens, cache=make_prompt_cache(model))
    text = text_model(model)
    raw = (
        text.lm_head(hidden)
        if module == "granite"
        else body_of(model).embed_tokens.as_linear(hidden)
    )
    full = model(tokens, cache=make_prompt_cache(model))
    assert not mx.allclose(raw, full, atol=1e-2, rtol=1e-2)
    assert mx.allclose(output_head(model, hidden), full, atol=1e-4, rtol=1e-4)


def test_a_wrapped_models_vocabulary_is_as_wide_as_its_logits(demo):
    """A wrapper's config holds its vocabulary in its language model's (Qwen3.5, `mistral3`):
    the bound every token id is checked against is still the logits' width."""
    for module in ("qwen3_5", "mistral3", "gemma3"):
        model = build(BY_MODULE[module], vocab_size=demo.vocab_size + 64)
        loaded = dataclasses.replace(demo, model=model)
        width = model(mx.array([[1, 2]]), cache=make_prompt_cache(model)).shape[-1]
        assert loaded.vocab_size == width == demo.vocab_size + 64, module


def test_a_body_is_found_under_each_layout():
    assert body_of(build(BY_MODULE["nemotron_h"])).__class__.__name__ == "NemotronHModel"
    wrapped = build(BY_MODULE["mistral3"])
    assert body_of(wrapped) is wrapped.language_model.model
    assert body_of(object()) is None
    assert not split_head_works(object())


@pytest.mark.parametrize(
    ("module", "fuses"),
    [
        ("mistral3", True),
        ("qwen3_5", True),
        ("nemotron_h", True),
        ("gemma4_text", True),
        ("gpt_oss", True),
    ],
)
async def test_greedy_tokens_through_the_engine_are_mlx_lms_own(
    module: str, fuses: bool, tmp_path: Path, model_cache_dir: Path
):
    """A llama model inside `mistral3`'s wrapper (head split, steps fused), a Qwen3.5
    hybrid under its wrapper and a Nemotron-H (their gated-delta and Mamba2 layers run per
    segment inside the fused step), a soft-capped Gemma 4 and a gpt-oss (attention sinks, MoE;
    both with 16-token sliding windows, fused): requests of mixed lengths at once, prefilled
    in chunks beside each other's decode rows, each get mlx-lm's greedy tokens."""
    path = model_dir(BY_MODULE[module], tmp_path / module)
    reference = load_model(str(path)).model
    lengths = [5, 37, 90, 1, 60]
    prompts = [[3 + (i * 7 + j * 13) % 250 for j in range(n)] for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results: dict[int, list[int]] = {}
    async with Engine.open(str(path), max_step_tokens=32, max_num_seqs=8) as engine:
        runner = engine.step_loop.runner
        assert runner.forwards.split_head and runner.fuse == fuses

        async def one(i: int) -> None:
            stream = await engine.submit(prompts[i], params=params)
            results[i] = [t async for out in stream for t in out.token_ids]

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
    for i, prompt in enumerate(prompts):
        assert results[i] == mlx_lm_greedy(reference, prompt, 12), i
