"""A prompt chunk with a checkpoint inside it rides the step's one forward: its cache is
snapshotted there inside that forward (recurrent layers run piece by piece, KV layers cut
back after it), so on a hybrid or sliding-window model every request's final chunk, which
holds its own checkpoint one token before its end, shares the step's forward; and every
request still gets mlx-lm's own tokens, and a snapshot serves a later prompt exactly."""

from __future__ import annotations

import random
from typing import Any

import anyio
import mlx.core as mx
import pytest
from helpers import mlx_lm_greedy, run_plans
from mlx_lm.models.cache import make_prompt_cache

from stepline.actors.scheduler.plan import ScheduledChunk
from stepline.actors.scheduler.work import NewRequest, StepWork
from stepline.api import Engine, SamplingParams
from stepline.engine import fused
from stepline.engine import step as step_module
from stepline.engine.models import LoadedModel
from stepline.engine.prefix_cache import share_cache
from stepline.engine.runner import ModelRunner
from stepline.events.models import RequestParams

GREEDY = RequestParams(max_tokens=8, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)
DEMOS = {"demo": "stepline-demo", "demo_hybrid": "stepline-demo-hybrid"}
DEMOS["demo_sliding"] = "stepline-demo-sliding"


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


class Forwards:
    """The runner's forwards by kind (a fused one, a chunk's own, the decode batch's), and
    the chunks that ran in a forward of their own."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, runner: ModelRunner):
        self.calls: list[str] = []
        self.apart: list[ScheduledChunk] = []
        real_run, real_forward = fused.run, step_module.forward
        real_decode, real_prefill = runner.forwards.decode, runner.forwards.prefill

        def fused_run(*a: Any, **kw: Any) -> Any:
            self.calls.append("fused")
            return real_run(*a, **kw)

        def chunk_forward(*a: Any, **kw: Any) -> Any:
            self.calls.append("chunk")
            return real_forward(*a, **kw)

        def decode(*a: Any, **kw: Any) -> Any:
            self.calls.append("decode")
            return real_decode(*a, **kw)

        def prefill(chunk: ScheduledChunk) -> Any:
            self.apart.append(chunk)
            return real_prefill(chunk)

        monkeypatch.setattr(fused, "run", fused_run)
        monkeypatch.setattr(step_module, "forward", chunk_forward)
        runner.forwards.decode, runner.forwards.prefill = decode, prefill


def inside(chunk: ScheduledChunk) -> bool:
    return any(chunk.start < k < chunk.end for k in chunk.checkpoints)


PROMPT, OTHER = ids(40, seed=5), ids(10, seed=6)


def _steps(runner: ModelRunner) -> list[dict[str, int]]:
    """r's first chunk (a checkpoint at its end) beside o's whole prompt; then r's final
    chunk, with checkpoints at 25 and 39 inside it, beside o's decode row."""
    news = (NewRequest("r", tuple(PROMPT), GREEDY), NewRequest("o", tuple(OTHER), GREEDY))
    plans = [
        ((ScheduledChunk("r", 0, 16, (16,), False), ScheduledChunk("o", 0, 10, (), True)), ()),
        ((ScheduledChunk("r", 16, 40, (25, 39), True),), ("o",)),
        ((), ("o", "r")),
    ]
    return run_plans(runner, news, plans, look_ahead=True)


def _is_prefix(model: Any, snapshot: list, tokens: list[int]) -> bool:
    """Whether `snapshot` gives the next token the logits of a cache prefilled with `tokens`."""
    fresh = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=fresh)
    nxt = mx.array([[tokens[-1]]])
    got, want = model(nxt, cache=share_cache(snapshot)), model(nxt, cache=fresh)
    return bool(mx.allclose(got, want, atol=1e-4))


@pytest.mark.parametrize("name", list(DEMOS))
def test_a_chunk_with_checkpoints_inside_rides_the_fused_forward_with_exact_snapshots(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
):
    """On the dense, hybrid and sliding-window demos: r's final chunk, with two checkpoints
    inside it, runs in the step's one forward beside o's decode row (no forward of its own,
    none a piece); each snapshot gives the next token's logits of a cache prefilled to
    exactly its offset (the window has wrapped by then); the tokens are those of separate
    forwards and of mlx-lm alone."""
    loaded: LoadedModel = request.getfixturevalue(name)
    snaps: dict[int, list] = {}
    runner = ModelRunner(loaded, on_checkpoint=lambda rid, k, cache: snaps.setdefault(k, cache))
    assert runner.forwards.fuses_snapshots
    counted = Forwards(monkeypatch, runner)
    tokens = _steps(runner)
    assert counted.calls[:2] == ["fused", "fused"] and not counted.apart
    assert "chunk" not in counted.calls
    assert sorted(snaps) == [16, 25, 39]
    for k, snapshot in snaps.items():
        assert _is_prefix(loaded.model, snapshot, PROMPT[:k]), k
    assert tokens == _steps(ModelRunner(loaded, fuse=False))
    assert [t["r"] for t in tokens if "r" in t] == mlx_lm_greedy(loaded.model, PROMPT, 2)


def test_where_snapshots_in_a_fused_forward_are_not_proven_such_a_chunk_runs_apart(
    demo: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    """A model on which a fused forward's snapshot is not the prefix (here: KV layers left
    uncut) fails the proof; its steps still fuse, but a chunk with a checkpoint inside runs
    alone, a forward a piece, and its snapshots are still exact."""
    with monkeypatch.context() as patched:
        patched.setattr(fused, "_cut_back", lambda layer, n: share_cache([layer])[0])
        assert not fused.snapshot_fused_works(demo.model)
        kind = step_module.forwards_kind(demo.model, fuse=True)
    assert kind[0].fuses and not kind[0].fuses_snapshots
    snaps: dict[int, list] = {}
    runner = ModelRunner(
        demo, forwards=kind, on_checkpoint=lambda rid, k, cache: snaps.setdefault(k, cache)
    )
    counted = Forwards(monkeypatch, runner)
    tokens = _steps(runner)
    # r's final chunk alone, in three forwards (to 25, to 39, to 40), and o's decode alone
    assert counted.calls[:5] == ["fused", "chunk", "chunk", "chunk", "decode"]
    assert [c.end for c in counted.apart] == [40]
    for k, snapshot in snaps.items():
        assert _is_prefix(demo.model, snapshot, PROMPT[:k]), k
    assert tokens == _steps(ModelRunner(demo, fuse=False))


@pytest.mark.parametrize("name", list(DEMOS))
async def test_concurrent_prompts_fuse_their_checkpointed_chunks_and_snapshots_serve_exactly(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
):
    """Three prompts at once, each with a checkpoint (a chat's message boundary; on the
    hybrid and sliding demos also their own, one token before the end), chunked under a
    32-token budget: every chunk with a checkpoint inside rides a fused forward, and every
    request gets mlx-lm's own greedy tokens. Then the longest prompt sent again reuses all
    but its last token, and one that shares only its first 20 tokens reuses those 20, each
    with mlx-lm's tokens (on the hybrid and sliding demos only a snapshot can serve them)."""
    loaded: LoadedModel = request.getfixturevalue(name)
    prompts = [ids(45, seed=1), ids(70, seed=2), ids(90, seed=3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got: dict[int, list[int]] = {}
    planned: list[ScheduledChunk] = []

    async def one(i: int, prompt: list[int]) -> int:
        stream = await engine.submit(prompt, params=params, checkpoints=[20])
        outs = [o async for o in stream]
        got[i] = [t for o in outs for t in o.token_ids]
        return outs[-1].num_cached_tokens

    async with Engine.open(DEMOS[name], max_step_tokens=32, max_num_seqs=4) as engine:
        runner = engine.step_loop.runner
        counted = Forwards(monkeypatch, runner)
        run = runner.run

        def recorded(work: StepWork) -> Any:
            planned.extend(work.plan.chunks)
            return run(work)

        runner.run = recorded
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(prompts):
                    tg.start_soon(one, i, prompt)
            assert await one(3, prompts[2]) == len(prompts[2]) - 1
            shares = [*prompts[2][:20], *ids(30, seed=4)]
            assert await one(4, shares) == 20
    assert sum(map(inside, planned)) >= len(prompts)  # at least each first one's
    assert not [c for c in counted.apart if inside(c)]
    for i, prompt in enumerate([*prompts, prompts[2], shares]):
        assert got[i] == mlx_lm_greedy(loaded.model, prompt, 6), i
