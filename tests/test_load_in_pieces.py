"""A model loading beside others holds the one MLX thread for a small piece of work at a time
(api/engine_parts.py runs each step of these generators as a job of its own): its weights a
piece of rows at a time, its proofs' and its memory plan's forwards a few layers at a time.
The pieces give the same weights, the same answers and the same plan as the whole."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from stepline.engine import forward, memory, models
from stepline.engine.step import forwards_kind_steps


def steps_of(steps: Generator[None, None, Any]) -> tuple[int, Any]:
    """How many steps a generator of steps took, and what it returned."""
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return count, done.value
        count += 1


@pytest.mark.parametrize("name", ["demo", "demo_hybrid", "demo_sliding"])
def test_a_proofs_forwards_run_a_layer_a_step_and_decide_what_they_decide_whole(
    name, request, monkeypatch
):
    loaded = request.getfixturevalue(name)
    whole_steps, whole = steps_of(forwards_kind_steps(loaded.model, fuse=True))
    assert whole[0].fuses and whole[1]  # every proof ran to its end and passed
    num_layers = len(forward.body_of(loaded.model).layers)
    # the demos' layers are far under a piece: each forward is its layers' step and its head's
    forwards = whole_steps // 2
    monkeypatch.setattr(forward, "FORWARD_PIECE_BYTES", 1)  # a layer a step
    steps, kind = steps_of(forwards_kind_steps(loaded.model, fuse=True))
    assert kind == whole
    assert steps == forwards * (num_layers + 1)


def test_a_forward_computed_a_layer_a_step_gives_the_logits_computed_at_once(demo, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    model = demo.model
    tokens = mx.array([[5, 6, 7, 8, 9]])
    at_once = model(tokens, cache=make_prompt_cache(model))
    mx.eval(at_once)
    monkeypatch.setattr(forward, "FORWARD_PIECE_BYTES", 1)
    cache = make_prompt_cache(model)
    logits = model(tokens, cache=cache)
    steps, _ = steps_of(forward.evaluated(model, logits, cache))
    assert steps == len(cache) + 1
    assert mx.array_equal(logits, at_once).item()


def test_the_memory_plans_forward_a_layer_a_step_measures_the_same_footprint(
    demo_hybrid, monkeypatch
):
    model = demo_hybrid.model
    whole = memory.measure_kv_footprint(model)
    monkeypatch.setattr(forward, "FORWARD_PIECE_BYTES", 1)
    steps, footprint = steps_of(memory.kv_footprint_steps(model))
    assert footprint == whole
    assert steps == len(forward.body_of(model).layers) + 1


def _quantized_demo() -> nn.Module:
    model = models.load_model("stepline-demo", dtype="keep").model
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    ("make", "dtype"),
    [(_quantized_demo, "float32"), (lambda: models.load_model("stepline-demo").model, "bfloat16")],
    ids=["dequantized", "cast"],
)
def test_lazy_weights_are_computed_a_piece_a_step_and_equal_those_computed_at_once(
    make, dtype, model_cache_dir, monkeypatch
):
    """Each step computes at most a piece of new weights, but for a weight over a piece,
    whose blocks of rows come first (a step each) and then its whole copy."""
    at_once = make()
    models.fit_dtype(at_once, dtype)
    piece = 64 * 2**10  # the demo's embedding and head are 256 KB in float32
    monkeypatch.setattr(models, "WEIGHTS_PIECE_BYTES", piece)
    lazy = make()
    models.fit_dtype(lazy, dtype, evaluate=False)
    big = {id(a): a.nbytes for _, a in tree_flatten(lazy.parameters()) if a.nbytes > piece}
    assert len(big) >= 2
    computed: list[int] = []  # the bytes each step computed (a fixed cost model)
    real_eval = mx.eval

    def recorded(*arrays: Any) -> None:
        computed.append(sum(a.nbytes for _, a in tree_flatten(list(arrays))))
        real_eval(*arrays)

    steps = models.weights_steps(lazy)
    monkeypatch.setattr(mx, "eval", recorded)
    num_steps, _ = steps_of(steps)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert num_steps == len(computed)
    copies = [n for n in computed if n > piece]
    assert sorted(copies) == sorted(big.values())  # each big weight copied once, whole
    assert sum(computed) - sum(copies) >= sum(big.values())  # after its blocks, a step each
    got, want = dict(tree_flatten(lazy.parameters())), dict(tree_flatten(at_once.parameters()))
    assert got.keys() == want.keys()
    for name, array in want.items():
        assert got[name].dtype == array.dtype and mx.array_equal(got[name], array).item(), name
