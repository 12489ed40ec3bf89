"""Prompt attention in blocks on the CPU: what MLX's own attention computes, to float32's
rounding, for every shape a prompt chunk takes."""

from __future__ import annotations

import importlib
import inspect

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from stepline.engine import cpu_attention
from stepline.engine.cpu_attention import causal_attention, fast_exp, row_attention, weights


def test_fast_exp_is_exp_to_float32_rounding_and_negligible_where_exp_underflows():
    x = mx.concatenate([mx.linspace(-100, 0, 100_001), mx.array([-mx.inf, -1e30])])
    ours, exact = fast_exp(x), mx.exp(x)
    kept = exact >= 2.0**-125.5
    assert mx.all(mx.where(kept, mx.abs(ours - exact) <= 3e-7 * exact, True)).item()
    assert mx.all(mx.where(kept, True, ours <= 2.6e-38)).item()
    assert mx.all(ours >= 2.0**-126).item()  # never subnormal


def test_the_weights_attention_multiplies_are_never_subnormal_and_make_the_softmax():
    # a causal block's masked keys (-inf) beside 2,000 visible ones: normalized, their
    # weights were subnormal, which x86 reads ~50x slower
    scores = mx.random.normal((2, 3, 8, 2048), key=mx.random.key(0))
    scores = mx.where(mx.arange(2048) < 2000, scores, -mx.inf)
    w, inverse_sum = weights(scores)
    assert mx.all(w >= 2.0**-126).item()
    softmax = mx.softmax(scores, axis=-1)
    assert mx.allclose(w * inverse_sum, softmax, rtol=1e-5, atol=1e-12).item()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "queries", "keys"),
    [
        (9, 3, 2, 2),  # a two-token prompt
        (9, 3, 40, 1840),  # a small chunk late in a long prompt
        (4, 4, 300, 300),  # a whole prompt, no grouping, several blocks
        (8, 2, 513, 1500),  # blocks that do not divide the chunk
        (2, 1, 7, 9),
    ],
)
def test_blocked_attention_matches_mlx_causal_attention(heads, kv_heads, queries, keys):
    mx.random.seed(queries)
    q = mx.random.normal((1, heads, queries, 64))
    k = mx.random.normal((1, kv_heads, keys, 64))
    v = mx.random.normal((1, kv_heads, keys, 64))
    ours = causal_attention(q, k, v, scale=0.125)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert ours.shape == theirs.shape
    assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_decode_rows_attention_matches_mlx_under_a_batch_caches_padding(mask_kind):
    mx.random.seed(7)
    rows, keys = 5, 1200
    q = mx.random.normal((rows, 9, 1, 64))
    k = mx.random.normal((rows, 3, keys, 64))
    v = mx.random.normal((rows, 3, keys, 64))
    padding = mx.array([0, 10, 600, 1100, 3])  # each row's left padding, as a batch has
    visible = (mx.arange(keys)[None] >= padding[:, None]).reshape(rows, 1, 1, keys)
    mask = {
        "none": None,
        "bool": visible,
        "additive": mx.where(visible, 0.0, -mx.inf),
    }[mask_kind]
    ours = row_attention(q, k, v, 0.125, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5).item()


def test_a_model_prefilled_in_chunks_gives_the_logits_of_mlx_lms_attention(demo):
    model = demo.model
    module = importlib.import_module(type(model).__module__)
    assert cpu_attention.install(model)  # the CPU backend: installed (idempotent)
    wrapped = module.scaled_dot_product_attention
    prompt = mx.array([[3 + (i * 37) % 250 for i in range(300)]])

    def chunked() -> mx.array:
        cache = make_prompt_cache(model)
        for start in range(0, 240, 60):
            model(prompt[:, start : start + 60], cache=cache)
        return model(prompt[:, 240:], cache=cache)[0, -1]

    ours = chunked()
    # mlx-lm's own function, inside every stepline wrapper (the fused step's may go around
    # the CPU attention's, whichever test installed it first)
    module.scaled_dot_product_attention = inspect.unwrap(wrapped)
    try:
        theirs = chunked()
    finally:
        module.scaled_dot_product_attention = wrapped
    assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4).item()
    assert mx.argmax(ours).item() == mx.argmax(theirs).item()


def test_blocks_on_two_streams_give_the_one_streams_numbers_on_any_thread(monkeypatch):
    """A chunk's blocks alternate between CPU streams (one thread of elementwise work each):
    the same numbers as one stream gives, bit for bit, on the engine's executor thread too."""
    from concurrent.futures import ThreadPoolExecutor

    mx.random.seed(3)
    q = mx.random.normal((1, 9, 200, 64))
    k = mx.random.normal((1, 3, 4000, 64))
    v = mx.random.normal((1, 3, 4000, 64))
    monkeypatch.setattr(cpu_attention, "STREAMS", 1)
    one = causal_attention(q, k, v, scale=0.125)
    mx.eval(one)
    monkeypatch.setattr(cpu_attention, "STREAMS", 2)

    def two() -> mx.array:
        out = causal_attention(q, k, v, scale=0.125)
        mx.eval(out)
        return out

    with ThreadPoolExecutor(1) as pool:
        elsewhere = pool.submit(two).result()
    assert mx.array_equal(two(), one).item()
    assert mx.array_equal(elsewhere, one).item()
