"""Gated DeltaNet's prompt recurrence in blocks (`engine/gated_delta.py`) is mlx-lm's
recurrence: the same outputs and state to float32 rounding at every length around a
block's, from a state or from none, with grouped key heads and gates near 0 and 1; calls
it does not cover are mlx-lm's own, unchanged; and a hybrid model's greedy answer is the
same token for token whichever of the two runs its prompts."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest
from families import FAMILIES, build
from mlx_lm.generate import generate_step
from mlx_lm.models import gated_delta as mlx_lm_gated_delta

from stepline.engine import gated_delta

BY_MODULE = {f.module: f for f in FAMILIES}


def inputs(length: int, *, gate_shift: float = 0.0, state: bool = True, seed: int = 0):
    """Arguments of `gated_delta_update` as a Qwen3-Next layer makes them: 2 key heads
    shared by 4 value heads, unit-norm keys."""
    mx.random.seed(seed)
    batch, key_heads, heads, dim = 2, 2, 4, 32
    q = mx.random.normal((batch, length, key_heads, dim))
    k = mx.random.normal((batch, length, key_heads, dim))
    q, k = mlx_lm_gated_delta.normalize_qk(q, k, inv_scale=dim**-0.5, eps=1e-6)
    v = mx.random.normal((batch, length, heads, dim))
    a = mx.random.normal((batch, length, heads)) + gate_shift
    b = mx.random.normal((batch, length, heads))
    a_log = mx.random.normal((heads,)) * 0.5
    dt_bias = mx.random.normal((heads,))
    start = mx.random.normal((batch, heads, dim, dim)) * 0.3 if state else None
    return q, k, v, a, b, a_log, dt_bias, start


def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time `gated_delta.chunked` runs."""
    calls: list[int] = []
    own = gated_delta.chunked
    monkeypatch.setattr(gated_delta, "chunked", lambda *a: calls.append(1) or own(*a))
    return calls


def assert_close(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.allclose(got, want, atol=2e-6, rtol=1e-5), float(mx.abs(got - want).max())


@pytest.mark.parametrize("length", [8, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("gate_shift", [-6.0, 0.0, 6.0], ids=["fast-decay", "mid", "slow-decay"])
def test_blocks_give_mlx_lms_outputs_and_state(
    length: int, gate_shift: float, monkeypatch: pytest.MonkeyPatch
):
    args = inputs(length, gate_shift=gate_shift)
    want_y, want_state = mlx_lm_gated_delta.gated_delta_update(*args)
    blocks = spy(monkeypatch)
    got_y, got_state = gated_delta.update(*args)
    assert blocks  # the blocks computed it, not mlx-lm's loop
    assert_close(got_y, want_y)
    assert_close(got_state, want_state)


def test_a_prompt_without_a_state_and_one_split_in_two_reach_the_same_state():
    """From no state (a request's first chunk), and a prompt in two calls, the second
    from the first's state, as a chunked prefill runs it."""
    q, k, v, a, b, a_log, dt_bias, _ = inputs(90, state=False)
    want_y, want_state = mlx_lm_gated_delta.gated_delta_update(q, k, v, a, b, a_log, dt_bias)
    first_y, mid = gated_delta.update(
        q[:, :40], k[:, :40], v[:, :40], a[:, :40], b[:, :40], a_log, dt_bias
    )
    second_y, end = gated_delta.update(
        q[:, 40:], k[:, 40:], v[:, 40:], a[:, 40:], b[:, 40:], a_log, dt_bias, mid
    )
    assert_close(mx.concatenate([first_y, second_y], axis=1), want_y)
    assert_close(end, want_state)


def test_calls_it_does_not_cover_are_mlx_lms_own_to_the_bit():
    """A decode row (one token), a short chunk and a batch's padded rows (a mask) run
    mlx-lm's function itself."""
    for length, masked in [(1, False), (gated_delta.MIN_TOKENS - 1, False), (40, True)]:
        q, k, v, a, b, a_log, dt_bias, state = inputs(length)
        mask = (
            mx.arange(length)[None, :] < mx.array([[length], [length // 2 + 1]]) if masked else None
        )
        want = mlx_lm_gated_delta.gated_delta_update(q, k, v, a, b, a_log, dt_bias, state, mask)
        got = gated_delta.update(q, k, v, a, b, a_log, dt_bias, state, mask)
        for x, y in zip(got, want, strict=True):
            assert mx.array_equal(x, y)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("module", ["qwen3_next", "qwen3_5"])
def test_a_hybrid_models_greedy_answer_is_the_same_with_the_blocks(
    module: str, monkeypatch: pytest.MonkeyPatch
):
    """A 300-token prompt through mlx-lm's own generation, then 24 greedy tokens: the same
    answer with the prompt's recurrence in blocks as with mlx-lm's per-token loop."""
    model = build(BY_MODULE[module])
    prompt = [(7 * i + 3) % 250 + 1 for i in range(300)]
    with gated_delta.mlx_lm_own():
        want = greedy(model, prompt, 24)
    assert gated_delta.install(model)
    assert importlib.import_module(f"mlx_lm.models.{module}").gated_delta_update is (
        gated_delta.update
    )
    blocks = spy(monkeypatch)
    assert greedy(model, prompt, 24) == want
    assert blocks  # the prompt's layers went through the blocks


def test_a_model_without_gated_deltanet_layers_is_left_alone():
    model = build(BY_MODULE["llama"])
    assert not gated_delta.install(model)
