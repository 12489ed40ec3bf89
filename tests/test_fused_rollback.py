"""A fused forward that fails after it wrote into the caches (`FusedForwards._forward`) puts
every cache back exactly (`rollback.Held`): a recurrent layer's state, which its mixer
updates in place, and a sliding window's ring, which a decode row writes over, included; so
the step runs again as separate forwards and every request's tokens are the ones it gets
when nothing failed."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from helpers import mlx_lm_greedy, run_plans

from stepline.actors.scheduler.plan import ScheduledChunk
from stepline.actors.scheduler.work import NewRequest
from stepline.engine import fused
from stepline.engine.models import LoadedModel
from stepline.engine.runner import ModelRunner
from stepline.events.models import RequestParams

GREEDY = RequestParams(max_tokens=16, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


# a: past the sliding demo's 16-token window; b: inside it (so its batch row is left-padded);
# c: prefilled in two chunks beside their decode rows
PROMPTS = {"a": ids(30, seed=1), "b": ids(5, seed=2), "c": ids(20, seed=3)}


def _steps(runner: ModelRunner, sampled: list[mx.array]) -> list[dict[str, int]]:
    """a and b prefill whole; c's two chunks beside a's and b's decode rows (one fused
    forward each); then four steps where all three decode. Each step's logits go in
    `sampled`."""
    start = runner.sampler.start

    def spy(logits: mx.array, *a: Any, **kw: Any) -> Any:
        sampled.append(logits)
        return start(logits, *a, **kw)

    runner.sampler.start = spy  # type: ignore[method-assign]
    news = tuple(NewRequest(rid, tuple(p), GREEDY) for rid, p in PROMPTS.items())
    plans = [
        ((ScheduledChunk("a", 0, 30, (), True), ScheduledChunk("b", 0, 5, (), True)), ()),
        ((ScheduledChunk("c", 0, 8, (), False),), ("a", "b")),
        ((ScheduledChunk("c", 8, 20, (), True),), ("a", "b")),
        *[((), ("a", "b", "c"))] * 4,
    ]
    return run_plans(runner, news, plans)


@pytest.mark.parametrize("name", ["demo_hybrid", "demo_sliding"])
@pytest.mark.parametrize("fails_at", [2, 3])
def test_a_fused_forward_that_fails_after_writing_the_caches_changes_no_token(
    name: str, fails_at: int, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
):
    """On the hybrid and the sliding-window demos: the fused forward of step `fails_at` (c's
    chunk beside a's and b's decode rows) runs the whole model into every segment's cache,
    evaluates it, then raises; the step runs separate forwards, and every step's logits and
    every request's greedy tokens are those of the same steps where nothing failed (and the
    tokens mlx-lm's own)."""
    loaded: LoadedModel = request.getfixturevalue(name)
    want_logits: list[mx.array] = []
    want = _steps(ModelRunner(loaded, lookahead=False), want_logits)
    real_run, calls = fused.run, []

    def fails_once(model: Any, segments: list[fused.Segment], rows: Any) -> fused.Fused:
        calls.append([s.is_batch for s in segments])
        if len(calls) != fails_at:
            return real_run(model, segments, rows)
        fused.body(model, segments)
        mx.eval([[c.state for c in s.cache] for s in segments])
        raise RuntimeError("injected fault after the caches were written")

    runner = ModelRunner(loaded, lookahead=False)
    assert runner.fuse
    monkeypatch.setattr(fused, "run", fails_once)
    got_logits: list[mx.array] = []
    got = _steps(runner, got_logits)
    assert calls[fails_at - 1] == [False, True]  # c's chunk and the decode rows it failed
    assert got == want
    assert len(got_logits) == len(want_logits)
    for i, (g, w) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert g.shape == w.shape and mx.allclose(g, w, atol=1e-4).item(), i
    for rid, prompt in PROMPTS.items():
        ours = [step[rid] for step in got if rid in step]
        assert ours == mlx_lm_greedy(loaded.model, prompt, len(ours)), rid
