"""Quantized KV (`--kv-bits`): requests batched and chunked compute what mlx-lm's own
`QuantizedKVCache` generation computes for each alone; memory, the prefix cache and the
event log count and keep the quantized arrays; a setting the model cannot take is refused
at startup, with the reason.

The demo models' attention heads are 16 wide, and MLX quantizes groups of 32, 64 or 128:
the tests build the same recipes with 32-wide heads (`wide`)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import submit_together
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache
from pydantic import ValidationError

from stepline.api import Engine, SamplingParams
from stepline.engine import cpu_attention
from stepline.engine.kv_quant import (
    BatchQuantizedKVCache,
    KVQuant,
    KVQuantError,
    QuantizedKVCache,
    make_cache,
)
from stepline.engine.models import DEMO_MODELS, DemoSpec, LoadedModel, _build, load_model
from stepline.engine.prefix_cache import share_cache

GROUP = 32  # the wide demos' heads are 32 wide
WIDE = ("stepline-demo", "stepline-demo-hybrid", "stepline-demo-sliding")


def prompt_ids(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _wide(name: str) -> DemoSpec:
    spec = DEMO_MODELS[name]
    extra = dict(spec.extra)
    extra["head_dim"] = 32
    return dataclasses.replace(spec, extra=tuple(extra.items()))


@pytest.fixture(scope="module")
def wide(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The llama, hybrid and sliding-window demos' recipes with 32-wide heads: name -> model
    directory."""
    root = tmp_path_factory.mktemp("wide-demos")
    out = {}
    for name in WIDE:
        path = root / name
        path.mkdir()
        _build(_wide(name), path)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module", params=WIDE)
def model(request, wide) -> str:
    """Each wide demo: plain KV layers; recurrent layers beside them (their state kept as
    it is); sliding windows beside them (unquantized: mlx-lm has no quantized ring)."""
    return wide[request.param]


def mlx_lm_quantized(model, prompt: list[int], n: int, bits: int, group: int = GROUP):
    """mlx-lm's own greedy generation for `prompt` alone over its `QuantizedKVCache`, built
    from the first token (as `quantized_kv_start=0`), every other layer as mlx-lm makes it;
    its attention mlx-lm's own (`quantized_matmul`), not the CPU's dequantized one that
    stepline's wrapper of the model's module gives a quantized cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_attention, "DEQUANTIZE", False)
        return _generate_quantized(model, prompt, n, bits, group)


def _generate_quantized(model, prompt: list[int], n: int, bits: int, group: int) -> list[int]:
    cache = [
        mlx_cache.QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=n,
        sampler=lambda x: mx.argmax(x, axis=-1),
        prompt_cache=cache,
    )
    return [int(t) for t, _ in steps]


async def _together(name: str, prompts, n: int, **options) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    async with Engine.open(name, **{"max_num_seqs": 8, **options}) as engine:
        streams = await submit_together(engine, [{"prompt": p, "params": params} for p in prompts])
        return [[t async for out in s for t in out.token_ids] for s in streams]


# -- the batch cache ----------------------------------------------------------------


def test_a_batch_of_quantized_caches_gives_each_row_its_solo_logits(wide):
    """merge, extend, filter and extract: every row decodes as it would alone."""
    loaded = load_model(wide["stepline-demo"])
    model, kv = loaded.model, KVQuant(8, GROUP)
    prompts = [prompt_ids(n, seed=n) for n in (5, 40, 300)]
    caches = []
    for p in prompts:
        cache = make_cache(model, kv)
        model(mx.array(p)[None], cache=cache)
        caches.append(cache)
    assert all(type(c) is QuantizedKVCache for c in caches[0])
    inputs = [p[-1] for p in prompts]
    alone = [share_cache(c) for c in caches]  # each request's own, decoding alone

    def solo(row: int, token: int) -> mx.array:
        return model(mx.array([[token]]), cache=alone[row])[0, -1]

    batch = [QuantizedKVCache.merge([a, b]) for a, b in zip(caches[0], caches[1], strict=True)]
    for mine, theirs in zip(batch, caches[2], strict=True):
        mine.extend(QuantizedKVCache.merge([theirs]))
    assert all(type(c) is BatchQuantizedKVCache for c in batch)
    logits = model(mx.array(inputs)[:, None], cache=batch)[:, -1]
    for row, token in enumerate(inputs):
        assert mx.allclose(logits[row], solo(row, token), atol=1e-4)
    # The middle row leaves the batch with its own cache; every row decodes on as alone.
    extracted = [layer.extract(1) for layer in batch]
    for layer in batch:
        layer.filter([0, 2])
    nxt = mx.argmax(logits, axis=-1).tolist()
    rows = model(mx.array([nxt[0], nxt[2]])[:, None], cache=batch)[:, -1]
    left = model(mx.array([[nxt[1]]]), cache=extracted)[0, -1]
    assert mx.allclose(rows[0], solo(0, nxt[0]), atol=1e-4)
    assert mx.allclose(rows[1], solo(2, nxt[2]), atol=1e-4)
    assert mx.allclose(left, solo(1, nxt[1]), atol=1e-4)
    assert batch[0].offset.tolist() == [7, 302] and batch[0].left_padding.tolist() == [295, 0]


# -- exactness against mlx-lm -------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
async def test_batched_and_chunked_requests_get_mlx_lms_quantized_tokens(model, bits):
    """Several requests of mixed lengths in small steps (chunked prefill, a shared decode
    batch, fused steps where the model fuses): each gets the tokens mlx-lm generates for it
    alone over a `QuantizedKVCache` of the same bits."""
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate((5, 37, 120, 64, 250))]
    got = await _together(model, prompts, 10, kv_bits=bits, kv_group_size=GROUP, max_step_tokens=32)
    loaded = load_model(model)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == mlx_lm_quantized(loaded.model, prompt, 10, bits)


async def test_smollm2_at_8_bits_gives_mlx_lms_quantized_tokens(smollm2: LoadedModel):
    """The real default model (64-wide heads, groups of 64), three requests batched."""
    prompts = [prompt_ids(n, seed=i, vocab=20000) for i, n in enumerate((6, 30, 70))]
    got = await _together(smollm2.name, prompts, 6, kv_bits=8, max_step_tokens=24)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == mlx_lm_quantized(smollm2.model, prompt, 6, 8, group=64)


# Bits -> the most a quantized KV moves the first logits of the wide llama demo from its
# unquantized KV's (float32), measured: 8 bits ~1e-3, 4 bits ~2e-2 (its logits span ~±1).
LOGIT_TOLERANCE = {8: 0.005, 4: 0.05}


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_logits_stay_within_the_stated_tolerance_of_unquantized_ones(wide, bits):
    loaded = load_model(wide["stepline-demo"])
    prompt = prompt_ids(200, seed=3)
    plain = loaded.model(mx.array(prompt)[None], cache=make_prompt_cache(loaded.model))
    cache = make_cache(loaded.model, KVQuant(bits, GROUP))
    quantized = loaded.model(mx.array(prompt)[None], cache=cache)
    diff = float(mx.abs(quantized[0, -1] - plain[0, -1]).max().item())
    assert 0 < diff <= LOGIT_TOLERANCE[bits]


# -- memory, the prefix cache, the log ----------------------------------------------


async def test_the_kv_budget_admits_the_quantized_bytes_per_token(wide):
    """The scheduler's budget in tokens is the engine's measured quantized bytes a token:
    at 8 bits (float32 scales and biases, groups of 32) 1.25 of float32's 4 bytes a number,
    at 4 bits 0.75."""
    name = wide["stepline-demo"]
    seen = {}
    for bits in (None, 8, 4):
        async with Engine.open(name, kv_bits=bits, kv_group_size=GROUP, max_kv_gb=0.01) as e:
            config = e.step_loop.config
            seen[bits] = (config.kv_bytes_per_token, config.max_kv_tokens)
    plain = seen[None][0]
    assert seen[8][0] == plain * 1.25 / 4 and seen[4][0] == plain * 0.75 / 4
    assert seen[8][1] >= 3 * seen[None][1] and seen[4][1] >= 5 * seen[None][1]


async def test_the_prefix_cache_keeps_quantized_arrays_in_memory_and_on_disk(model, tmp_path):
    """A checkpoint's entry serves a later request from memory, and after a restart from its
    file; its arrays are the quantized ones, and the tokens are those of a cold run."""
    system, first = prompt_ids(40, 1), [7, *prompt_ids(5, 2)]
    second, third = [8, *prompt_ids(5, 3)], [9, *prompt_ids(5, 4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    options = {"kv_bits": 8, "kv_group_size": GROUP, "max_step_tokens": 16, "max_num_seqs": 4}
    stored = []
    async with Engine.open(model, prefix_cache_dir=tmp_path, **options) as engine:
        stream = await engine.submit(system + first, params=params, checkpoints=(40,))
        [o async for o in stream]
        store = engine.step_loop.runner.store
        kept = await engine.step_loop.executor.call(lambda: store.get(tuple(system), 40))
        stored = [type(c).__name__ for c in kept]
        warm = await engine.submit(system + second, params=params)
        warm_outs = [o async for o in warm]
    assert "QuantizedKVCache" in stored and "KVCache" not in stored
    assert warm_outs[-1].num_cached_tokens == 40
    async with Engine.open(model, prefix_cache_dir=tmp_path, **options) as engine:
        disk = await engine.submit(system + third, params=params)
        disk_outs = [o async for o in disk]
    assert disk_outs[-1].num_cached_tokens == 40
    both = [system + second, system + third]
    cold = await _together(model, both, 6, prefix_cache_gb=0, **options)
    tokens = [[t for o in outs for t in o.token_ids] for outs in (warm_outs, disk_outs)]
    assert tokens == cold
    # The files are mlx-lm's own prompt-cache files of its `QuantizedKVCache`.
    for path in tmp_path.glob("*.safetensors"):
        read = mlx_cache.load_prompt_cache(str(path))
        quantized = [c for c in read if isinstance(c, mlx_cache.QuantizedKVCache)]
        assert quantized and all(c.bits == 8 and c.keys[0].dtype == mx.uint32 for c in quantized)


async def test_the_event_log_header_records_the_kv_quantization(wide, tmp_path):
    from stepline.events.log_reader import read_header

    log = tmp_path / "events.jsonl"
    async with Engine.open(wide["stepline-demo"], kv_bits=4, kv_group_size=GROUP, event_log=log):
        pass
    header = read_header(log)
    assert header.config["kv_bits"] == 4 and header.config["kv_group_size"] == GROUP


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("option", [{"kv_bits": 3}, {"kv_bits": 8, "kv_group_size": 16}])
async def test_bits_or_a_group_size_mlx_does_not_quantize_are_refused(option):
    with pytest.raises(ValidationError, match="kv_"):
        async with Engine.open("stepline-demo", **option):
            pass


async def test_a_group_size_that_does_not_divide_the_heads_is_refused_at_startup(demo):
    with pytest.raises(KVQuantError, match="16-wide attention heads") as error:
        async with Engine.open("stepline-demo", kv_bits=8):
            pass
    assert "--kv-group-size" not in str(error.value)  # no group size fits 16: no hint of one
    assert "without --kv-bits" in str(error.value)


def test_a_models_file_sets_the_kv_bits_of_one_model_and_refuses_bits_mlx_has_not(tmp_path):
    from stepline.api.config import read_models_file

    good = tmp_path / "models.toml"
    good.write_text(
        '[models.a]\nmodel = "x"\nkv_bits = 4\nkv_group_size = 32\n[models.b]\nmodel = "y"\n'
    )
    a, b = read_models_file(good)
    assert (a.engine_config({}).kv_bits, a.engine_config({}).kv_group_size) == (4, 32)
    assert b.engine_config({}).kv_bits is None
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.a]\nmodel = "x"\nkv_bits = 2\n')
    with pytest.raises(ValueError, match="kv_bits"):
        read_models_file(bad)


async def test_mlx_lms_quantized_attention_gives_the_same_tokens_as_the_cpus_dequantized(
    wide, monkeypatch
):
    """The attention other backends run (mlx-lm's `quantized_matmul`, on the packed keys),
    batched and chunked, against the CPU's own (dequantized each step): the same tokens."""
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate((9, 70, 150))]
    options = {"kv_bits": 8, "kv_group_size": GROUP, "max_step_tokens": 32}
    dequantized = await _together(wide["stepline-demo"], prompts, 8, **options)
    monkeypatch.setattr(cpu_attention, "DEQUANTIZE", False)
    assert await _together(wide["stepline-demo"], prompts, 8, **options) == dequantized


async def test_drafted_decoding_over_quantized_kv_keeps_the_tokens(wide):
    """n-gram drafts verified against quantized caches (their rejected tokens cut back out
    of them): the tokens of plain decoding, for prompts that repeat themselves (drafts
    found) and one that does not."""
    base = prompt_ids(30, seed=5)
    prompts = [base * 3, base[:10] * 5, prompt_ids(50, seed=6)]
    options = {"kv_bits": 8, "kv_group_size": GROUP, "max_step_tokens": 32, "max_num_seqs": 4}
    plain = await _together(wide["stepline-demo"], prompts, 24, **options)
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    drafted = await _together(
        wide["stepline-demo"], prompts, 24, speculative_config=ngram, **options
    )
    assert drafted == plain
