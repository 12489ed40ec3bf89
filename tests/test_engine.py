"""The engine as a Python user meets it: concurrency, cancellation, bad input, failure."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import os
import threading

import anyio
import pydantic
import pytest
from helpers import collect, wait_finished, wait_until

import stepline.actors.scheduler.core as core_module
from stepline.actors.executor import Executor, ExecutorDeadError
from stepline.actors.request import IncrementalDetokenizer, RequestOutput
from stepline.api import (
    ContextLengthExceededError,
    EmptyPromptError,
    Engine,
    EngineDeadError,
    SamplingParams,
)
from stepline.events.fold import Status, fold
from stepline.events.log import read_events
from stepline.events.models import Admitted, FinishReason, StepPlanned, Terminal, TokensSampled

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def long_prompt(n: int) -> list[int]:
    return [3 + (i * 37) % 250 for i in range(n)]


async def tokens_of(stream) -> list[int]:
    return [t for o in await collect(stream) for t in o.token_ids]


async def test_generate_streams_text_and_ends_with_one_finish(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        outs = [
            o
            async for o in engine.generate(
                messages=[{"role": "user", "content": "hi"}],
                params=SamplingParams(max_tokens=10, temperature=0.7, seed=1, ignore_eos=True),
            )
        ]
    assert [o.finish_reason for o in outs].count("length") == 1
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 10
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 10
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(tokens)


async def test_same_seed_gives_the_same_text_even_in_a_different_batch(model_cache_dir):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    prompt = "the same question"
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=8) as engine:
        alone = [
            t
            for o in await collect(await engine.submit(prompt, params=params))
            for t in o.token_ids
        ]
        streams = [await engine.submit(prompt, params=params)]
        streams += [
            await engine.submit(f"noise {i}", params=params.model_copy(update={"seed": i}))
            for i in range(5)
        ]
        crowded = await tokens_of(streams[0])
        for s in streams[1:]:
            await collect(s)
        unseeded = [
            [
                t
                for o in await collect(
                    await engine.submit(prompt, params=params.model_copy(update={"seed": None}))
                )
                for t in o.token_ids
            ]
            for _ in range(2)
        ]
    assert alone == crowded
    assert unseeded[0] != unseeded[1]


async def test_32_concurrent_requests_each_reach_exactly_one_terminal(tmp_path, model_cache_dir):
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=8, event_log=log
    ) as engine:
        finals = []

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=4 + i % 5, temperature=0.8, seed=i)
            outs = await collect(await engine.submit(long_prompt(10 + 7 * i), params=params))
            finals.append([o.finish_reason for o in outs if o.finish_reason])

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(one, i)
    assert len(finals) == 32 and all(len(f) == 1 for f in finals)
    events = list(read_events(log))
    terminals = [e for e in events if isinstance(e, Terminal)]
    admitted = {e.request_id for e in events if isinstance(e, Admitted)}
    assert len(admitted) == 32
    assert sorted(t.request_id for t in terminals) == sorted(admitted)


async def test_a_request_submitted_while_a_step_runs_is_admitted_for_the_next_step(
    tmp_path, model_cache_dir
):
    # Waiting requests age by the steps since their admission (the policy's MAX_WAIT_STEPS):
    # one that arrived while step N ran must count from step N + 1, the first it can join.
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=8, event_log=log
    ) as engine:
        busy = await engine.submit(
            long_prompt(8), params=GREEDY.model_copy(update={"max_tokens": 200})
        )
        loop, late = engine.step_loop, []
        for i in range(5):
            await wait_until(loop, lambda i=i: loop.step >= 5 * (i + 1))
            late.append(await engine.submit(long_prompt(9 + i), params=GREEDY))
        for s in (busy, *late):
            await collect(s)
    last_planned = 0
    admitted_at = {}
    for e in read_events(log):
        if isinstance(e, StepPlanned):
            last_planned = e.step
        elif isinstance(e, Admitted):
            admitted_at[e.request_id] = (e.step, last_planned)
    assert len(admitted_at) == 6
    for rid, (step, planned_before) in admitted_at.items():
        assert step == planned_before + 1, rid


def _slow_to_prepare(engine: Engine, until: dict[str, anyio.Event]) -> None:
    """Make the tokenization of some prompts (by text) finish only once `until[text]` is set."""
    prepare = engine.prepare_async

    async def slow(prompt, messages, template_kwargs):
        if prompt in until:
            await until[prompt].wait()
        return await prepare(prompt, messages, template_kwargs)

    engine.prepare_async = slow  # type: ignore[method-assign]


def _first_step(log) -> tuple[StepPlanned, dict[str, int]]:
    """The log's first step, and each request's admission (seq) in the log."""
    events = list(read_events(log))
    admitted = {e.request_id: e.seq for e in events if isinstance(e, Admitted)}
    return next(e for e in events if isinstance(e, StepPlanned)), admitted


async def test_an_idle_engine_gathers_a_burst_so_its_first_step_takes_the_shortest(
    tmp_path, model_cache_dir
):
    # The long prompt is tokenized first; the short ones once it is. Without waiting for
    # them, the first step would be the long prompt's alone and they would wait for it.
    log = tmp_path / "run.jsonl"
    texts = {"long": "a long prompt " * 12, **{f"short-{i}": f"hi {i}" for i in range(4)}}
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=8, event_log=log
    ) as engine:
        long_prepared = anyio.Event()
        _slow_to_prepare(engine, {t: long_prepared for rid, t in texts.items() if rid != "long"})
        prepare = engine.prepare_async

        async def prepare_then_release(prompt, messages, template_kwargs):
            prepared = await prepare(prompt, messages, template_kwargs)
            if prompt == texts["long"]:
                long_prepared.set()
            return prepared

        engine.prepare_async = prepare_then_release  # type: ignore[method-assign]

        async def one(rid: str) -> None:
            await collect(await engine.submit(texts[rid], params=GREEDY, request_id=rid))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for rid in texts:
                    tg.start_soon(one, rid)
    first, _ = _first_step(log)
    assert {e.request_id for e in first.entries} >= {f"short-{i}" for i in range(4)}


async def test_a_request_slow_to_prepare_does_not_hold_up_the_first_step(tmp_path, model_cache_dir):
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=8, event_log=log
    ) as engine:
        # "slow" is tokenized only once the first step has run: that step cannot wait for it.
        stepped = anyio.Event()
        engine.step_loop.on_step = lambda loop: stepped.set()
        _slow_to_prepare(engine, {"slow": stepped})

        async def one(text: str) -> None:
            await collect(await engine.submit(text, params=GREEDY, request_id=text))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "quick")
                tg.start_soon(one, "slow")
    first, admitted = _first_step(log)
    assert [e.request_id for e in first.entries] == ["quick"]
    assert first.seq < admitted["slow"]


async def test_folding_the_log_rebuilds_the_live_state_at_every_step(tmp_path, model_cache_dir):
    log = tmp_path / "run.jsonl"
    live: dict[int, dict] = {}
    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=4, event_log=log
    ) as engine:
        engine.step_loop.on_step = lambda loop: live.__setitem__(loop.step, dict(loop.states))
        streams = [
            await engine.submit(long_prompt(n), params=GREEDY, checkpoints=(n // 2,))
            for n in (70, 5, 33, 100)
        ]
        for s in streams[:3]:
            await collect(s)
        await streams[3].aclose()  # one cancelled mid-prefill too
        loop = engine.step_loop
        await wait_finished(loop, streams[3].request_id)
        ended = {s.request_id: loop.state_of(s.request_id) for s in streams}
    events = list(read_events(log))
    assert fold(events) == ended  # every request's final state, from the log alone
    partial_seen = False
    for step, states in live.items():
        # the live scheduling state is the fold, for the requests not yet ended
        folded = fold(events, until_step=step)
        assert {r: s for r, s in folded.items() if not s.is_finished} == states, f"step {step}"
        partial_seen |= any(s.status is Status.PREFILLING for s in states.values())
    assert partial_seen  # the check covered partial prefill progress


async def test_breaking_out_mid_decode_cancels_and_frees_the_slot(tmp_path, model_cache_dir):
    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=4, event_log=tmp_path / "l.jsonl"
    ) as engine:
        other = await engine.submit(
            "bystander", params=SamplingParams(max_tokens=40, ignore_eos=True)
        )
        stream = await engine.submit(
            "hello", params=SamplingParams(max_tokens=500, ignore_eos=True)
        )
        async for out in stream:
            if out.num_output_tokens >= 3:
                break
        await stream.aclose()
        loop = engine.step_loop
        assert (await wait_finished(loop, stream.request_id)).finish_reason == "cancelled"
        outs = await collect(other)  # the bystander is unaffected
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 40
        await wait_until(loop, lambda: loop.runner.num_sequences == 0)


async def test_just_breaking_out_of_generate_cancels_the_request(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        loop = engine.step_loop
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        async for out in engine.generate("hello", params=params):
            if out.num_output_tokens >= 2:
                rid = out.request_id
                break  # no aclose(): what users write
        state = await wait_finished(loop, rid)
        assert state.finish_reason == "cancelled"
        assert state.num_output_tokens < 50
        await wait_until(loop, lambda: loop.runner.num_sequences == 0)


async def test_cancelling_mid_prefill_frees_the_slot_within_a_step(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=16, max_num_seqs=4) as engine:
        loop = engine.step_loop

        async def consume(stream):
            async for _ in stream:
                pass

        stream = await engine.submit(long_prompt(1500), params=GREEDY)
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, stream)
            rid = stream.request_id
            await wait_until(loop, lambda: loop.state_of(rid).status is Status.PREFILLING)
            step_at_cancel = loop.step
            tg.cancel_scope.cancel()  # the consuming task is cancelled
        await stream.aclose()
        state = await wait_finished(loop, stream.request_id)
        assert state.finish_reason == "cancelled"
        assert state.num_computed_tokens < 1500
        assert state.finished_step <= step_at_cancel + 2
        await wait_until(loop, lambda: loop.runner.num_sequences == 0)


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: SamplingParams(max_tokens=0), pydantic.ValidationError),
        (lambda: SamplingParams(temperature=math.nan), pydantic.ValidationError),
        (lambda: SamplingParams(temperature=-0.5), pydantic.ValidationError),
        (lambda: SamplingParams(top_p=0.0), pydantic.ValidationError),
        (lambda: SamplingParams(top_p=1.5), pydantic.ValidationError),
    ],
)
def test_bad_sampling_params_name_the_field(make, error):
    with pytest.raises(error) as err:
        make()
    field = str(err.value).split("\n")[1]
    assert field in ("max_tokens", "temperature", "top_p")


async def test_a_request_asking_past_the_context_ends_by_length_where_the_context_ends(
    tmp_path, model_cache_dir
):
    log = tmp_path / "l.jsonl"
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    async with Engine.open(
        "stepline-demo", max_step_tokens=512, max_num_seqs=4, event_log=log
    ) as engine:
        room = 3
        outs = await collect(
            await engine.submit(long_prompt(engine.max_context - room), params=params)
        )
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == room
    assert sum(len(o.token_ids) for o in outs) == room
    (admitted,) = [e for e in read_events(log) if isinstance(e, Admitted)]
    assert admitted.params.max_tokens == room  # the limit it ran to, as replay reads it


async def test_bad_requests_are_refused_clearly_and_the_engine_serves_on(tmp_path, model_cache_dir):
    log = tmp_path / "l.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=4, event_log=log
    ) as engine:
        with pytest.raises(EmptyPromptError, match="empty"):
            await engine.submit([], params=GREEDY)
        with pytest.raises(ContextLengthExceededError, match=str(engine.max_context)):
            await engine.submit(long_prompt(engine.max_context + 5), params=GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.submit([1, 2, 10**9], params=GREEDY)
        with pytest.raises(ValueError, match="exactly one"):
            await engine.submit("a", messages=[{"role": "user", "content": "b"}])
        outs = await collect(await engine.submit("still serving", params=GREEDY))
        assert outs[-1].finish_reason == "length"
    rejected = [e for e in read_events(log) if isinstance(e, Terminal) and e.reason == "rejected"]
    assert len(rejected) == 2 and "shorten the prompt" in rejected[1].message


async def test_a_dead_executor_ends_every_request_with_an_error_and_refuses_new_ones(
    model_cache_dir,
):
    async with Engine.open("stepline-demo", max_step_tokens=16, max_num_seqs=4) as engine:
        loop = engine.step_loop
        streams = [
            await engine.submit(
                long_prompt(n), params=SamplingParams(max_tokens=200, ignore_eos=True)
            )
            for n in (3, 400)
        ]
        await wait_until(loop, lambda: loop.step >= 3)

        def broken(work):
            raise RuntimeError("simulated MLX failure")

        loop.runner.run = broken
        with anyio.fail_after(10):
            results = [await collect(s) for s in streams]
        assert [r[-1].finish_reason for r in results] == ["error", "error"]
        assert "simulated MLX failure" in results[0][-1].error
        assert not engine.healthy and "simulated MLX failure" in engine.unhealthy_reason
        with pytest.raises(EngineDeadError, match="unhealthy"):
            await engine.submit("anyone there?", params=GREEDY)


async def test_a_bug_in_the_step_loop_fails_requests_instead_of_hanging_them(
    model_cache_dir, monkeypatch
):
    async with Engine.open("stepline-demo", max_step_tokens=16, max_num_seqs=4) as engine:
        stream = await engine.submit("hello", params=SamplingParams(max_tokens=100))
        loop = engine.step_loop
        await wait_until(loop, lambda: loop.step >= 2)

        def broken(*args):
            raise KeyError("a bug in the commit")

        monkeypatch.setattr(loop.core, "update_from_output", broken)
        with anyio.fail_after(10):
            outs = await collect(stream)
        assert outs[-1].finish_reason == "error" and "a bug in the commit" in outs[-1].error
        assert not engine.healthy


async def test_a_bug_in_admitting_a_request_fails_its_submit_instead_of_hanging_it(
    model_cache_dir, monkeypatch
):
    async with Engine.open("stepline-demo", max_step_tokens=16, max_num_seqs=4) as engine:

        def broken(*args):
            raise KeyError("a bug in admission")

        monkeypatch.setattr(core_module, "check_admissible", broken)
        with anyio.fail_after(10), pytest.raises(EngineDeadError, match="admitting"):
            await engine.submit("hello", params=SamplingParams(max_tokens=4))
        assert not engine.healthy


async def test_ended_requests_leave_the_scheduling_state_and_ids_are_not_reused(
    model_cache_dir,
):
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        loop = engine.step_loop
        for i in range(6):
            await collect(await engine.submit(f"q{i}", params=GREEDY, request_id=f"id-{i}"))
        assert loop.states == {}  # a step's work does not grow with requests served
        assert loop.state_of("id-3").finish_reason == "length"
        with pytest.raises(ValueError, match="already used"):
            await engine.submit("again", params=GREEDY, request_id="id-3")


async def test_a_failing_request_actor_ends_only_its_request(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        other = await engine.submit("fine", params=SamplingParams(max_tokens=30, ignore_eos=True))
        real = engine._detokenizer  # makes each request actor's detokenizer

        class Broken:
            def add(self, token_id):
                raise UnicodeError("detokenizer bug")

            def finalize(self):
                return ""

        engine._detokenizer = Broken  # only the next request's actor gets it
        doomed = await engine.submit("x", params=SamplingParams(max_tokens=500, ignore_eos=True))
        engine._detokenizer = real
        with anyio.fail_after(10):
            outs = await collect(doomed)
        assert outs[-1].finish_reason == "error" and "detokenizer bug" in outs[-1].error
        loop = engine.step_loop
        state = await wait_finished(loop, doomed.request_id)
        assert state.finish_reason == "error"
        assert state.num_output_tokens < 10  # stopped promptly
        assert (await collect(other))[-1].finish_reason == "length"
        assert engine.healthy


async def test_latency_metrics_measure_the_gaps_between_tokens(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        await collect(
            await engine.submit("hi", params=SamplingParams(max_tokens=20, ignore_eos=True))
        )
        state = engine.step_loop.state_of(next(iter(engine.step_loop.finished)))
        samples = {m.name: m.samples for m in engine.metrics.registry.collect()}
    itl = {
        s.name.rsplit("_", 1)[-1]: s.value for s in samples["stepline_inter_token_latency_seconds"]
    }
    assert itl["count"] == 19
    assert itl["sum"] == pytest.approx(state.last_token_ts - state.first_token_ts, rel=1e-6)


async def test_metrics_show_what_runs_when_scraped(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        scraped = engine.metrics.registry.get_sample_value
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        streams = [await engine.submit(f"chat {i}", params=params) for i in range(2)]
        for stream in streams:
            await anext(stream)  # each has its first token: both decode
        assert scraped("stepline_requests_decoding") == 2
        assert scraped("stepline_requests_waiting") == scraped("stepline_requests_prefilling") == 0
        assert scraped("stepline_mlx_active_bytes") > 0  # the executor's last report
        steps = scraped("stepline_step_seconds_count")
        assert steps >= 2 and scraped("stepline_steps_total") == steps
        for stream in streams:
            await stream.aclose()
        await wait_until(engine.step_loop, lambda: engine.step_loop.settled)
        assert scraped("stepline_requests_decoding") == 0


async def test_the_executor_runs_one_job_at_a_time_on_one_thread():
    executor = Executor()
    active = 0
    overlaps = 0
    threads = set()

    def job(i: int) -> int:
        nonlocal active, overlaps
        active += 1
        overlaps += active > 1
        threads.add(threading.get_ident())
        os.sched_yield()  # the CPU given up mid-job: a job on a second thread would overlap it
        active -= 1
        return i

    results = []

    async def ask(i: int) -> None:
        results.append(await executor.call(job, i))

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(ask, i)
    assert sorted(results) == list(range(64))
    assert overlaps == 0 and threads == {executor.thread_id}

    def fail():
        raise ValueError("bad job")

    with pytest.raises(ValueError, match="bad job"):
        await executor.call(fail)
    executor.mark_dead(RuntimeError("gone"))
    with pytest.raises(ExecutorDeadError):
        await executor.call(job, 0)
    executor.close()


async def test_a_caller_cancelled_mid_job_leaves_the_job_to_finish_and_its_error_unread():
    executor = Executor()
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    unhandled: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))

    def slow_failure():
        started.set()
        release.wait(5)
        finished.set()
        raise ValueError("nobody reads this")

    caller = asyncio.ensure_future(executor.call(slow_failure))
    await anyio.to_thread.run_sync(started.wait, 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    assert await executor.call(lambda: "next") == "next"  # after the job, which finished
    assert finished.is_set() and executor.dead is None
    del caller
    gc.collect()
    await anyio.lowlevel.checkpoint()  # the loop's turn to report a never-retrieved exception
    assert unhandled == []  # no "exception was never retrieved"
    executor.close()


async def test_work_after_a_call_runs_next_on_the_executor_thread_once_it_succeeded():
    executor = Executor()
    order: list[str] = []
    released = threading.Event()

    def step() -> str:
        order.append("step")
        return "result"

    def after() -> None:
        released.wait(5)  # the step's result is back before this finishes
        order.append(f"after on {threading.get_ident() == executor.thread_id}")

    def next_job() -> None:
        order.append("next")

    def failing() -> None:
        raise ValueError("bad step")

    assert await executor.call(step, after=after) == "result"
    assert order == ["step"]  # its result came back while `after` was still running
    pending = asyncio.ensure_future(executor.call(next_job))
    released.set()
    await pending
    assert order == ["step", "after on True", "next"]  # next in line, on the MLX thread

    order.clear()
    with pytest.raises(ValueError, match="bad step"):
        await executor.call(failing, after=after)
    await executor.drain()
    assert order == []  # a failed call has nothing to follow it
    executor.close()


async def test_drain_settles_mlx_after_the_queued_jobs_unless_the_executor_is_dead():
    # An engine's close drains its executor, then waits for MLX work started asynchronously
    # (the decode look-ahead) so that none runs while the interpreter exits.
    executor = Executor()
    order: list[str] = []
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(5)
        order.append("job")

    queued = asyncio.ensure_future(executor.call(job))
    assert await anyio.to_thread.run_sync(started.wait, 5)  # the job runs: drain comes after it
    drained = asyncio.ensure_future(
        executor.drain(
            settle=lambda: order.append(f"settle on {threading.get_ident() == executor.thread_id}")
        )
    )
    release.set()
    await queued
    await drained
    assert order == ["job", "settle on True"]
    executor.mark_dead(RuntimeError("a job failed"))
    await executor.drain(settle=lambda: order.append("settled a dead one"))
    assert order == ["job", "settle on True"]  # MLX's state is unknown: left alone
    executor.close()


async def test_mlx_work_happens_on_the_executor_thread(model_cache_dir):
    seen = set()
    async with Engine.open(
        "stepline-demo",
        max_step_tokens=16,
        max_num_seqs=2,
        on_checkpoint=lambda *a: seen.add(threading.get_ident()),
    ) as engine:
        await collect(await engine.submit(long_prompt(40), params=GREEDY, checkpoints=(8, 20)))
        assert seen == {engine.step_loop.executor.thread_id}


async def test_stop_strings_end_the_text_before_them_and_are_never_emitted(model_cache_dir):
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        full = "".join(o.text for o in await collect(await engine.submit("tell me", params=base)))
        stop = full[12:15]
        cut = full.find(stop)
        outs = await collect(
            await engine.submit("tell me", params=base.model_copy(update={"stop": ("zzzq", stop)}))
        )
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == full[:cut]


async def test_a_stop_string_ends_its_request_in_the_step_that_found_it(model_cache_dir, tmp_path):
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    log = tmp_path / "run.jsonl"
    opened = Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4, event_log=log)
    async with opened as engine:
        full = "".join(o.text for o in await collect(await engine.submit("tell me", params=base)))
        stopped = base.model_copy(update={"stop": (full[12:15],)})
        outs = await collect(await engine.submit("tell me", params=stopped, request_id="s"))
    assert outs[-1].finish_reason == "stop"
    events = list(read_events(log))
    planned = [e.step for e in events if isinstance(e, StepPlanned) and "s" in e.request_ids]
    sampled = [e for e in events if isinstance(e, TokensSampled) and "s" in e.request_ids]
    end = next(e for e in events if isinstance(e, Terminal) and e.request_id == "s")
    # No step ran it after the one whose tokens held the stop string: it ended before the
    # next step was planned.
    assert planned[-1] == sampled[-1].step and end.reason is FinishReason.STOP
    after = [e.seq for e in events if isinstance(e, StepPlanned) and e.seq > sampled[-1].seq]
    assert not after or end.seq < after[0]
    assert outs[-1].num_output_tokens == sum(e.request_ids.count("s") for e in sampled)


async def test_a_stop_token_ends_the_request_and_is_counted_but_not_printed(model_cache_dir):
    base = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        ids = await tokens_of(await engine.submit("count", params=base))
        stop_id = ids[6]
        first = ids.index(stop_id)
        outs = await collect(
            await engine.submit(
                "count", params=base.model_copy(update={"stop_token_ids": (stop_id,)})
            )
        )
    got = [t for o in outs for t in o.token_ids]
    assert got == ids[: first + 1] and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(ids[:first])


async def test_a_reader_that_fell_behind_gets_what_it_missed_in_one_piece(model_cache_dir):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        prompt = "the same prompt, twice"
        prompt_outs = await collect(await engine.submit(prompt, params=params))
        late = await engine.submit(prompt, params=params)
        await wait_until(engine.step_loop, lambda: engine.step_loop.settled)  # all made
        late_outs = await collect(late)
    assert len(late_outs) == 1  # the whole output, as one
    (out,) = late_outs
    assert out.finish_reason == "length" and out.num_output_tokens == 30
    assert out.token_ids == tuple(t for o in prompt_outs for t in o.token_ids)
    assert out.text == "".join(o.text for o in prompt_outs)
    assert len(prompt_outs) > 1


def test_an_output_made_field_by_field_equals_one_made_by_its_constructor() -> None:
    values = {
        "request_id": "r",
        "text": "hi",
        "token_ids": (5, 6),
        "finish_reason": "length",
        "num_prompt_tokens": 3,
        "num_output_tokens": 2,
        "num_cached_tokens": 1,
        "num_computed_tokens": 3,
        "logprobs": (),
        "error": None,
        "embedding": None,
        "prefix_miss": "diverged",
        "prefix_shared": 2,
    }
    # every field, so that a field added to RequestOutput must be added to `made` too
    assert set(values) == {f.name for f in dataclasses.fields(RequestOutput)}
    made = RequestOutput.made(**values)
    assert made == RequestOutput(**values) and vars(made) == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.text = "changed"  # type: ignore[misc]


async def test_streamed_text_never_splits_a_utf8_character(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        # The demo tokenizer is byte-level: an emoji is several tokens.
        emoji = "héllo 👋🏽 世界 ✓"
        ids = engine.tokenizer.encode(emoji, add_special_tokens=False)
        assert len(ids) > len(emoji)
        detok = IncrementalDetokenizer(engine.tokenizer.decode)
        pieces = [detok.add(t) for t in ids] + [detok.finalize()]
        assert "".join(pieces) == emoji and all("\ufffd" not in p for p in pieces)
        assert any(p == "" for p in pieces)  # held back mid-character
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=7, ignore_eos=True)
        outs = await collect(await engine.submit(emoji, params=params))
    tokens = [t for o in outs for t in o.token_ids]
    whole = engine.tokenizer.decode(tokens)
    assert "".join(o.text for o in outs) == whole
    if "\ufffd" not in whole:
        assert all("\ufffd" not in o.text for o in outs)


async def test_an_open_engine_switches_threads_often_and_restores_the_setting(model_cache_dir):
    """The executor's look-ahead must not wait 5 ms for the GIL behind the event loop; the
    interpreter's own setting comes back when the engine closes."""
    import sys

    from stepline.api.engine import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    async with Engine.open("stepline-demo", max_step_tokens=32) as engine:
        assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
        await tokens_of(await engine.submit("hi", params=SamplingParams(max_tokens=2)))
    assert sys.getswitchinterval() == pytest.approx(before)
