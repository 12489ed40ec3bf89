"""A mixture's experts one matrix product each (`engine/experts.py`) are mlx-lm's expert
layers: the same outputs to float32 rounding for gated (`SwitchGLU`, biased as gpt-oss's)
and plain (`SwitchMLP`) experts, tokens routed to every expert or to a few; layers and
steps it does not take (a decode row, quantized experts) are mlx-lm's own to the bit; and
MoE models' greedy answers through it are the same token for token."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from families import FAMILIES, build
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from stepline.engine import experts

BY_MODULE = {f.module: f for f in FAMILIES}


@pytest.fixture(autouse=True)
def grouped():
    experts.install()


def routed(tokens: int, num_experts: int, k: int, *, few: bool = False, seed: int = 0):
    """`tokens` tokens' hidden states and the `k` distinct experts each is routed to (all
    among the first two experts' neighbourhood if `few`, so most experts take none)."""
    mx.random.seed(seed)
    x = mx.random.normal((2, tokens, 64))
    scores = mx.random.normal((2, tokens, num_experts))
    if few:
        scores = scores + mx.where(mx.arange(num_experts) < k + 1, 10.0, 0.0)
    return x, mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def layer(cls: type, *, bias: bool = False, seed: int = 1) -> nn.Module:
    mx.random.seed(seed)
    m = cls(64, 64, 8, bias=bias)
    mx.eval(m.parameters())
    return m


def mlx_lms(m: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    with experts.mlx_lm_own():
        return m(x, indices)


@pytest.mark.parametrize("cls", [SwitchGLU, SwitchMLP])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens,few", [(12, False), (100, False), (100, True)])
def test_grouped_experts_give_mlx_lms_outputs(cls: type, bias: bool, tokens: int, few: bool):
    m = layer(cls, bias=bias)
    x, indices = routed(tokens, 8, 2, few=few)
    want = mlx_lms(m, x, indices)
    got = m(x, indices)
    assert got.shape == want.shape == (2, tokens, 2, 64)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), float(mx.abs(got - want).max())


def test_a_decode_row_and_quantized_experts_are_mlx_lms_own_to_the_bit():
    m = layer(SwitchGLU)
    x, indices = routed(1, 8, 2)
    assert mx.array_equal(m(x[:1], indices[:1]), mlx_lms(m, x[:1], indices[:1]))
    q = layer(SwitchGLU)
    nn.quantize(q, group_size=32, bits=4)
    x, indices = routed(100, 8, 2)
    assert mx.array_equal(q(x, indices), mlx_lms(q, x, indices))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler)
    ]


@pytest.mark.parametrize("module", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_moe_models_greedy_answers_are_the_same_through_grouped_experts(
    module: str, monkeypatch: pytest.MonkeyPatch
):
    """A 200-token prompt (every expert takes many of its tokens) and 16 greedy tokens."""
    model = build(BY_MODULE[module])
    prompt = [(11 * i + 5) % 250 + 1 for i in range(200)]
    with experts.mlx_lm_own():
        want = greedy(model, prompt, 16)
    calls = []
    own = experts.grouped
    monkeypatch.setattr(experts, "grouped", lambda *a: calls.append(1) or own(*a))
    assert greedy(model, prompt, 16) == want
    assert calls  # the prompt's layers went through the grouped experts
