"""Chunked prefill, batching and checkpoints compute exactly what mlx-lm computes alone."""

from __future__ import annotations

import random

import anyio
import mlx.core as mx
import pytest
from helpers import mlx_lm_greedy, submit_together, wait_until
from mlx_lm.models.cache import make_prompt_cache

from stepline.actors.scheduler.plan import ScheduledChunk, StepPlan
from stepline.actors.scheduler.work import NewRequest, StepWork
from stepline.api import Engine, SamplingParams
from stepline.engine.decode_order import DecodeOrder
from stepline.engine.runner import ModelRunner
from stepline.engine.sampling import PendingSample
from stepline.events.models import RequestParams

GREEDY = RequestParams(max_tokens=64, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


@pytest.fixture(params=["demo", "demo_hybrid"])
def loaded(request):
    return request.getfixturevalue(request.param)


def prompt_ids(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def full_prefill_logits(loaded, prompt: list[int]) -> mx.array:
    cache = make_prompt_cache(loaded.model)
    return loaded.model(mx.array(prompt)[None], cache=cache)[:, -1, :]


class CapturingRunner(ModelRunner):
    """A real runner that also keeps the logits rows it sampled from in its steps (not those
    it builds ahead for the next step's decode)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sampled_logits: list[mx.array] = []
        self._ahead_of_step = False
        start = self.sampler.start

        def spy(logits, *args, **kwargs):
            if not self._ahead_of_step:
                self.sampled_logits.append(logits)
            return start(logits, *args, **kwargs)

        self.sampler.start = spy
        build = self.lookahead.build

        def build_ahead(*args, **kwargs) -> None:
            self._ahead_of_step = True
            try:
                build(*args, **kwargs)
            finally:
                self._ahead_of_step = False

        self.lookahead.build = build_ahead


def run_chunked(runner: ModelRunner, prompt: list[int], chunk: int, checkpoints=()) -> int:
    """Prefill `prompt` in chunks of `chunk` (ending at checkpoints); return the first token."""
    rid = "r"
    new = NewRequest(rid, tuple(prompt), GREEDY)
    start, step, token = 0, 0, None
    while start < len(prompt):
        end = min(start + chunk, len(prompt))
        c = ScheduledChunk(
            rid, start, end, tuple(k for k in checkpoints if start < k <= end), end == len(prompt)
        )
        step += 1
        plan = StepPlan(step=step, chunks=(c,), num_scheduled_tokens={rid: end - start})
        result = runner.run(StepWork(plan=plan, admit=(new,) if start == 0 else ()))
        token = result.tokens.get(rid)
        assert (token is not None) == c.is_final  # intermediate chunks sample nothing
        start = end
    return token


def decode(runner: ModelRunner, rid: str, n: int, first_step: int = 1000) -> list[int]:
    tokens = []
    for i in range(n):
        plan = StepPlan(step=first_step + i, decodes=(rid,), num_scheduled_tokens={rid: 1})
        tokens.append(runner.run(StepWork(plan=plan)).tokens[rid])
    return tokens


@pytest.mark.parametrize("chunk,length", [(1, 9), (7, 50), (7, 36), (64, 129), (64, 200)])
def test_chunked_prefill_gives_the_same_logits_and_tokens_as_mlx_lm(loaded, chunk, length):
    prompt = prompt_ids(length, seed=length)
    runner = CapturingRunner(loaded)
    first = run_chunked(runner, prompt, chunk)
    assert len(runner.sampled_logits) == 1  # logits exist only for the final chunk
    assert mx.allclose(runner.sampled_logits[0], full_prefill_logits(loaded, prompt), atol=1e-4)
    ours = [first, *decode(runner, "r", 7)]
    assert ours == mlx_lm_greedy(loaded.model, prompt, 8)


async def test_a_batch_of_mixed_lengths_gives_each_request_its_solo_tokens(loaded, model_cache_dir):
    lengths = [5, 37, 120, 64, 1, 250]
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    async with Engine.open(loaded.name, max_step_tokens=48, max_num_seqs=8) as engine:
        streams = [await engine.submit(p, params=params) for p in prompts]
        results = []
        for s in streams:
            results.append([t async for out in s for t in out.token_ids])
        shared_steps = engine.step_loop.step
    assert shared_steps < sum(len(p) // 48 + 10 for p in prompts)  # they really shared steps
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == mlx_lm_greedy(loaded.model, prompt, 10)


async def _leave_and_join(name: str, lookahead: bool, extra: dict) -> dict[str, list]:
    """Requests that end at different steps (their lengths, a cancel), and a second wave
    that joins the decode batch while the first still decodes; `extra`: one more request's
    sampling options, in the first wave (logprobs are kept under "extra-logprobs")."""
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 14)]
    seeded = SamplingParams(max_tokens=11, temperature=0.8, seed=5, ignore_eos=True)
    tokens: dict[str, list] = {}
    a1_decodes = anyio.Event()  # a1 has two tokens: the first wave decodes
    async with Engine.open(name, max_step_tokens=48, max_num_seqs=8) as engine:
        engine.step_loop.runner.lookahead.enabled = lookahead

        async def one(rid: str, prompt: list[int], params, cancel_after: int = 0) -> None:
            got = tokens.setdefault(rid, [])
            async with await engine.submit(prompt, params=params, request_id=rid) as stream:
                async for out in stream:
                    got.extend(out.token_ids)
                    if rid == "a1" and len(got) >= 2:
                        a1_decodes.set()
                    if out.logprobs:
                        lps = tokens.setdefault(f"{rid}-logprobs", [])
                        lps.extend((lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs)
                    if cancel_after and len(got) >= cancel_after:
                        return  # leaving the block cancels the rest

        async with anyio.create_task_group() as tg:
            for i, params in enumerate(greedy):
                tg.start_soon(one, f"a{i}", prompt_ids(20 + 7 * i, seed=i), params)
            tg.start_soon(one, "a-seeded", prompt_ids(33, seed=9), seeded)
            tg.start_soon(one, "a-cancelled", prompt_ids(12, seed=8), greedy[2], 4)
            if extra:
                params = SamplingParams(max_tokens=12, seed=4, ignore_eos=True, **extra)
                tg.start_soon(one, "extra", prompt_ids(25, seed=7), params)
            with anyio.fail_after(10):
                await a1_decodes.wait()
            for i, params in enumerate(greedy):  # the second wave, while the first decodes
                tg.start_soon(one, f"b{i}", prompt_ids(60 + i, seed=20 + i), params)
        loop = engine.step_loop
        await wait_until(loop, lambda: loop.runner.num_sequences == 0)
    return tokens


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"temperature": 0.7, "logprobs": 2},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 0, "repetition_penalty": 1.3},
    ],
    ids=["plain", "logprobs", "top-p", "penalty"],
)
async def test_looking_ahead_changes_no_token_while_requests_leave_and_join(
    loaded, model_cache_dir, extra
):
    """The next decode forward and its sampling start before their step is planned: rows
    that ended meanwhile are dropped unsampled, new rows wait for the forward after it.
    Every token is what a runner that never looks ahead makes, and greedy tokens are
    mlx-lm's own."""
    ahead = await _leave_and_join(loaded.name, lookahead=True, extra=extra)
    plain = await _leave_and_join(loaded.name, lookahead=False, extra=extra)
    assert {rid: toks for rid, toks in ahead.items() if rid != "a-cancelled"} == {
        rid: toks for rid, toks in plain.items() if rid != "a-cancelled"
    }
    assert ahead["a-cancelled"][:4] == plain["a-cancelled"][:4]  # cancelled after 4 tokens
    for wave, base in (("a", 0), ("b", 20)):
        for i, n in enumerate((3, 9, 14)):
            length = 20 + 7 * i if wave == "a" else 60 + i
            expected = mlx_lm_greedy(loaded.model, prompt_ids(length, seed=base + i), n)
            assert ahead[f"{wave}{i}"] == expected


async def _decode_step_calls(
    loaded, monkeypatch, params: SamplingParams, order: DecodeOrder, slow_pipeline: float = 0
) -> list[list[str]]:
    """Three requests of `params.max_tokens` tokens; each decode-only step's own calls
    ("forward": a decode forward built, "read": sampled tokens read, "start": MLX told to
    compute the next forward, in the step or right after it, as its result goes back), in
    order, while all three decode (an order is chosen for each batch size). The runner
    chooses orders with `order`; `slow_pipeline` adds that many seconds to every step that
    starts the next forward before it reads its tokens, on the clock `order` is given (the
    step times it measures), not the wall's."""
    calls: list[str] = []
    real_finish, real_start = PendingSample.finish, mx.async_eval

    def finish(self):
        calls.append("read")
        return real_finish(self)

    def start(*arrays):
        calls.append("start")
        return real_start(*arrays)

    monkeypatch.setattr(PendingSample, "finish", finish)
    monkeypatch.setattr(mx, "async_eval", start)
    # No step-time target: no warm-up, whose steps would run through the patched runner.
    opened = Engine.open(loaded.name, max_step_tokens=64, max_num_seqs=4, max_step_ms=None)
    async with opened as engine:
        runner = engine.step_loop.runner
        runner.lookahead.order = order
        real_run, real_pipeline, model = runner.run, runner.lookahead.pipeline, runner.model

        def run(work):
            decode_only = not work.plan.chunks and len(work.plan.decodes) == 3
            calls.append("decode-only run" if decode_only else "run")
            return real_run(work)

        late = 0.0  # seconds `order`'s clock is ahead of the wall's: the slow steps' time
        real_order_start = order.start

        def order_start(rows: int, now: float) -> bool:
            return real_order_start(rows, now + late)

        def pipeline(*args, start_now: bool):
            nonlocal late
            if start_now:
                late += slow_pipeline  # a slow forward, on the clock the order reads
            return real_pipeline(*args, start_now=start_now)

        monkeypatch.setattr(order, "start", order_start)

        class Forward:
            def __call__(self, inputs, cache):
                if inputs.shape[1] == 1:  # a decode forward (prompts here are longer)
                    calls.append("forward")
                return model(inputs, cache=cache)

            def __getattr__(self, name):
                return getattr(model, name)

        runner.run, runner.lookahead.pipeline, runner.model = run, pipeline, Forward()
        calls.clear()
        # Admitted together (63 tokens: one step), all three decode in every step but the last.
        requests = [dict(prompt=prompt_ids(20 + i, seed=i), params=params) for i in range(3)]
        for stream in await submit_together(engine, requests):
            got = [t async for out in stream for t in out.token_ids]
            assert len(got) == params.max_tokens
    steps, step = [], None
    for call in calls:
        if call.endswith("run"):
            step = [] if call == "decode-only run" else None
            if step is not None:
                steps.append(step)
        elif step is not None:
            step.append(call)
    return steps[:-1]  # the last one ends them: nothing more to build


# A decode-only step builds the next forward on its tokens before it reads them, and starts
# it before reading them (STARTED_FIRST, then its sampling as the result goes back) or only
# as the result goes back (STARTED_AFTER). Where reading the tokens is more than evaluating
# them, it reads them, then builds the next forward (READ_FIRST).
STARTED_FIRST = ["forward", "start", "read", "start"]
STARTED_AFTER = ["forward", "read", "start"]
READ_FIRST = ["read", "forward", "start"]


async def test_a_decode_only_step_builds_the_next_forward_before_it_reads_its_tokens(
    loaded, model_cache_dir, monkeypatch
):
    """As mlx-lm's own loop does: the host builds the next forward's graph while the
    device still computes this step's tokens, and may also start it before reading them, so
    that the device has it queued while the host reads. Where reading them is more than
    evaluating them (here: logprobs), the step reads them first."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    steps = await _decode_step_calls(loaded, monkeypatch, greedy, DecodeOrder(fixed=True))
    assert len(steps) >= 8 and all(step == STARTED_FIRST for step in steps), steps
    steps = await _decode_step_calls(loaded, monkeypatch, greedy, DecodeOrder(fixed=False))
    assert len(steps) >= 8 and all(step == STARTED_AFTER for step in steps), steps
    with_logprobs = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    steps = await _decode_step_calls(loaded, monkeypatch, with_logprobs, DecodeOrder(fixed=True))
    assert len(steps) >= 8 and all(step == READ_FIRST for step in steps), steps


async def test_decode_only_steps_keep_the_order_measured_faster(
    loaded, model_cache_dir, monkeypatch
):
    """Both orders are tried for a few steps; here starting the next forward before reading
    the tokens is made slower (20 ms more a step), so the steps after the trial start it
    only as their result goes back."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    order = DecodeOrder(block_steps=3)
    steps = await _decode_step_calls(loaded, monkeypatch, params, order, slow_pipeline=0.02)
    trial = [STARTED_FIRST] * 3 + [STARTED_AFTER] * 6 + [STARTED_FIRST] * 3
    assert steps[:12] == trial, steps
    assert len(steps) > 20 and all(step == STARTED_AFTER for step in steps[12:]), steps


def _layer_arrays(layer) -> list[mx.array]:
    """The arrays that define a cache layer's contents, independent of buffer padding."""
    if hasattr(layer, "keys") and layer.keys is not None:
        n = layer.offset
        return [layer.keys[..., :n, :], layer.values[..., :n, :]]
    if hasattr(layer, "cache"):
        return [a for a in layer.cache if a is not None]
    raise AssertionError(f"unknown cache kind {type(layer).__name__}")


def test_checkpoint_snapshots_equal_a_fresh_prefill_of_exactly_that_prefix(loaded):
    prompt = prompt_ids(90, seed=3)
    checkpoints = (5, 13, 30, 61, 90)
    snaps: dict[int, list] = {}
    runner = ModelRunner(loaded, on_checkpoint=lambda rid, k, cache: snaps.setdefault(k, cache))
    run_chunked(runner, prompt, chunk=8, checkpoints=checkpoints)  # resumes cross every one
    decode(runner, "r", 3)  # the live cache moves on; snapshots must not
    assert sorted(snaps) == list(checkpoints)
    for k, snap in snaps.items():
        fresh = make_prompt_cache(loaded.model)
        loaded.model(mx.array(prompt[:k])[None], cache=fresh)
        for got, want in zip(snap, fresh, strict=True):
            assert type(got) is type(want)
            for a, b in zip(_layer_arrays(got), _layer_arrays(want), strict=True):
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4)
        # and the snapshot continues exactly as the fresh cache does
        nxt = mx.array([[prompt[k - 1]]])
        assert mx.allclose(loaded.model(nxt, cache=snap), loaded.model(nxt, cache=fresh), atol=1e-4)


async def test_checkpoints_emit_events_and_reach_the_hook_while_still_prefilling(demo_hybrid):
    seen: list[tuple[str, int, int]] = []  # (request, offset, status when the hook ran)
    prompt = prompt_ids(100, seed=9)

    async with Engine.open(
        "stepline-demo-hybrid",
        max_step_tokens=16,
        max_num_seqs=4,
        on_checkpoint=lambda rid, k, cache: seen.append((rid, k, len(cache))),
    ) as engine:
        stream = await engine.submit(
            prompt, params=SamplingParams(max_tokens=1), checkpoints=(10, 40)
        )
        outs = [o async for o in stream]
        state = engine.step_loop.state_of(stream.request_id)
    assert [k for _, k, _ in seen] == [10, 40]  # the client's, only
    # and the engine's own, one token before the end: a hybrid's state serves only there
    assert state.checkpoints_reached == (10, 40, 99)
    assert any(o.is_progress and o.num_computed_tokens == 16 for o in outs)


@pytest.mark.parametrize("name", ["demo", "demo_hybrid", "demo_sliding"])
@pytest.mark.parametrize("cached", [0, 10])
def test_final_chunks_of_different_lengths_in_one_step_match_solo(request, name, cached):
    loaded = request.getfixturevalue(name)
    prompts = [prompt_ids(n, seed=n) for n in (3, 20, 41, 9)]  # the sliding window is 16
    runner = CapturingRunner(loaded)
    # some requests carry an earlier chunk first, so the batch merges caches of unequal lengths
    news = [NewRequest(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    starts = {f"r{i}": min(cached, len(p) - 1) for i, p in enumerate(prompts)}
    first = [
        ScheduledChunk(n.request_id, 0, starts[n.request_id], (), False)
        for n in news
        if starts[n.request_id]
    ]
    if first:
        plan = StepPlan(step=1, chunks=tuple(first), num_scheduled_tokens={})
        runner.run(StepWork(plan=plan, admit=tuple(news)))
    finals = tuple(
        ScheduledChunk(n.request_id, starts[n.request_id], len(n.prompt_token_ids), (), True)
        for n in news
    )
    plan = StepPlan(step=2, chunks=finals, num_scheduled_tokens={})
    result = runner.run(StepWork(plan=plan, admit=() if first else tuple(news)))
    logits = runner.sampled_logits[-1]
    assert logits.shape[0] == len(prompts)  # sampled together, one row each
    for i, p in enumerate(prompts):
        assert mx.allclose(logits[i : i + 1], full_prefill_logits(loaded, p), atol=1e-4), i
    # and they decode on, batched, exactly as mlx-lm does alone
    steps = [result.tokens[f"r{i}"] for i in range(len(prompts))]
    rids = tuple(f"r{i}" for i in range(len(prompts)))
    for step in range(3):
        plan = StepPlan(step=3 + step, decodes=rids, num_scheduled_tokens={})
        out = runner.run(StepWork(plan=plan)).tokens
        steps = [*steps, *[out[r] for r in rids]]
    for i, p in enumerate(prompts):
        assert steps[i :: len(prompts)] == mlx_lm_greedy(loaded.model, p, 4), i


def test_a_request_that_ends_at_its_first_token_never_joins_the_decode_batch(loaded):
    """Merging its cache would pad every decode row to its prompt's length, for nothing: it
    ends by length now. Its prompt still becomes a prefix-cache entry, and serves exactly."""
    runner = ModelRunner(loaded, prefix_cache_bytes=1 << 26)
    long_prompt, short_prompt = prompt_ids(60, seed=1), prompt_ids(5, seed=2)
    once = GREEDY.model_copy(update={"max_tokens": 1})
    news = (
        NewRequest("long", tuple(long_prompt), once),
        NewRequest("short", tuple(short_prompt), GREEDY),
    )
    plan = StepPlan(
        step=1,
        chunks=(ScheduledChunk("long", 0, 60, (), True), ScheduledChunk("short", 0, 5, (), True)),
        num_scheduled_tokens={"long": 60, "short": 5},
    )
    first = runner.run(StepWork(plan=plan, admit=news)).tokens
    assert first["long"] == mlx_lm_greedy(loaded.model, long_prompt, 1)[0]
    assert runner.batch.rows.ids == ["short"]  # the short request decodes alone

    plan = StepPlan(step=2, decodes=("short",), num_scheduled_tokens={"short": 1})
    work = StepWork(plan=plan, free=("long",), retire=frozenset({"long"}))
    second = runner.run(work).tokens
    assert [first["short"], second["short"]] == mlx_lm_greedy(loaded.model, short_prompt, 2)

    # A request with the same 60 tokens and more starts from the retired entry.
    follow_up = [*long_prompt, *prompt_ids(7, seed=3)]
    new = NewRequest(
        "next", tuple(follow_up), GREEDY, prefix=tuple(long_prompt), num_cached_tokens=60
    )
    plan = StepPlan(
        step=3,
        decodes=("short",),
        chunks=(ScheduledChunk("next", 60, 67, (), True),),
        num_scheduled_tokens={"short": 1, "next": 7},
    )
    assert (
        runner.run(StepWork(plan=plan, admit=(new,))).tokens["next"]
        == mlx_lm_greedy(loaded.model, follow_up, 1)[0]
    )
