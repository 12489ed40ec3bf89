"""Fault isolation: a fault the executor can pin on one request ends that request only;
a fault of the executor, or a bug in the step loop, makes the engine unhealthy, and says so.

The faults are injected into the real runner of a real demo-model engine.
"""

from __future__ import annotations

import math
from collections import Counter

import anyio
import pytest
from helpers import collect, submit_together, wait_until

from stepline.actors.messages import Cancel
from stepline.actors.scheduler.work import (
    ADMISSION_FAILED,
    CHECKPOINT_FAILED,
    PREFILL_FAILED,
    SAMPLING_FAILED,
)
from stepline.api import Engine, EngineDeadError, SamplingParams
from stepline.events.log import read_events
from stepline.events.models import CheckpointReached, ChunkPrefilled, Terminal

DOOMED_SEED = 666  # the doomed request's seed: how a patched sampler recognises its row


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 37 + salt * 11) % 250 for i in range(n)]


def params(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


# The bystanders: request id -> (prompt, params). Long enough to share steps with the doomed one.
OTHERS = {f"other-{i}": (prompt_of(20 + 15 * i, salt=i), params(seed=i)) for i in range(3)}


async def tokens_alone(engine: Engine) -> dict[str, list[int]]:
    """Each bystander's tokens when it runs alone (with fresh ids)."""
    alone = {}
    for rid, (prompt, p) in OTHERS.items():
        outs = await collect(await engine.submit(prompt, params=p, request_id=f"{rid}-alone"))
        alone[rid] = [t for o in outs for t in o.token_ids]
    return alone


async def run_together(engine: Engine, doomed_prompt: list[int], doomed: SamplingParams, **kw):
    """Submit the doomed request and the bystanders at once (all are admitted before any
    step: a fault can end them all only once they are in); return each one's outputs."""
    requests = {"doomed": (doomed_prompt, doomed), **OTHERS}
    submitted = await submit_together(
        engine,
        [
            dict(prompt=prompt, params=p, request_id=rid, **kw)
            for rid, (prompt, p) in requests.items()
        ],
    )
    streams = dict(zip(requests, submitted, strict=True))
    results: dict[str, list] = {}

    async def drain(rid: str) -> None:
        results[rid] = await collect(streams[rid])

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for rid in streams:
                tg.start_soon(drain, rid)
    return results


def assert_one_terminal_each(log, rids) -> list[Terminal]:
    terminals = [e for e in read_events(log) if isinstance(e, Terminal)]
    counts = Counter(t.request_id for t in terminals)
    assert all(counts[rid] == 1 for rid in rids), counts
    assert set(counts.values()) == {1}
    return terminals


def assert_only_doomed_failed(results, alone, log, message: str) -> None:
    doomed = results["doomed"]
    assert [o.finish_reason for o in doomed if o.finish_reason] == ["error"]
    assert doomed[-1].error == message
    for rid in OTHERS:
        assert results[rid][-1].finish_reason == "length"
        assert [t for o in results[rid] for t in o.token_ids] == alone[rid], rid
    terminals = assert_one_terminal_each(log, ["doomed", *OTHERS])
    (doomed_end,) = [t for t in terminals if t.request_id == "doomed"]
    assert doomed_end.reason == "error" and doomed_end.message == message


async def test_a_fault_in_one_requests_prefill_ends_only_that_request(tmp_path, model_cache_dir):
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=8, prefix_cache_gb=0, event_log=log
    ) as engine:
        alone = await tokens_alone(engine)
        runner = engine.step_loop.runner
        real_prefill, real_fusable = runner.forwards.prefill, runner.forwards.fusable

        def prefill(chunk):
            if chunk.request_id == "doomed" and chunk.start > 0:  # its second chunk
                raise RuntimeError("injected prefill fault")
            return real_prefill(chunk)

        def fusable(chunks, *args):  # the doomed request's chunks run a forward of their own
            return real_fusable([c for c in chunks if c.request_id != "doomed"], *args)

        runner.forwards.prefill, runner.forwards.fusable = prefill, fusable
        results = await run_together(engine, prompt_of(100, salt=9), params(seed=5))
        assert engine.healthy
        loop = engine.step_loop
        await wait_until(loop, lambda: runner.num_sequences == 0)  # nothing is left behind
        assert (await collect(await engine.submit("after", params=params(1))))[-1].finish_reason
    assert_only_doomed_failed(results, alone, log, PREFILL_FAILED)
    chunks = [e for e in read_events(log) if isinstance(e, ChunkPrefilled)]
    (first,) = [c for c in chunks if c.request_id == "doomed"]  # its second one failed
    assert first.start == 0 and first.end < 100


@pytest.mark.parametrize("failing_position", [0, 3], ids=["first-token", "mid-decode"])
async def test_a_fault_in_one_requests_sampling_row_ends_only_that_request(
    tmp_path, model_cache_dir, failing_position
):
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=8, prefix_cache_gb=0, event_log=log
    ) as engine:
        alone = await tokens_alone(engine)
        sampler = engine.step_loop.runner.sampler
        real_start = sampler.start  # every sampling, in a step or a step ahead, starts here

        def start(logits, rows, positions, histories=None):
            for row, pos in zip(rows, positions, strict=True):
                if row.seed == DOOMED_SEED and pos >= failing_position:
                    raise RuntimeError("injected sampling fault")
            return real_start(logits, rows, positions, histories)

        sampler.start = start
        results = await run_together(engine, prompt_of(10, salt=7), params(seed=DOOMED_SEED))
        assert engine.healthy
        loop = engine.step_loop
        await wait_until(loop, lambda: loop.runner.num_sequences == 0)
    assert_only_doomed_failed(results, alone, log, SAMPLING_FAILED)
    doomed_tokens = [t for o in results["doomed"] for t in o.token_ids]
    assert len(doomed_tokens) == failing_position  # what it got before the fault, no more


async def test_a_failing_checkpoint_hook_ends_only_its_request(tmp_path, model_cache_dir):
    log = tmp_path / "run.jsonl"
    hooked: list[tuple[str, int]] = []

    def on_checkpoint(request_id, offset, cache):
        if request_id == "doomed":
            raise ValueError("injected checkpoint fault")
        hooked.append((request_id, offset))

    async with Engine.open(
        "stepline-demo",
        max_step_tokens=32,
        max_num_seqs=8,
        prefix_cache_gb=0,
        event_log=log,
        on_checkpoint=on_checkpoint,
    ) as engine:
        alone = await tokens_alone(engine)
        results = await run_together(
            engine, prompt_of(40, salt=3), params(seed=5), checkpoints=(8,)
        )
        assert engine.healthy
        loop = engine.step_loop
        await wait_until(loop, lambda: loop.runner.num_sequences == 0)
    assert_only_doomed_failed(results, alone, log, CHECKPOINT_FAILED)
    reached = {e.request_id for e in read_events(log) if isinstance(e, CheckpointReached)}
    assert reached == set(OTHERS)  # the bystanders' hooks ran and were recorded; not the doomed
    assert ("doomed", 8) not in hooked and {rid for rid, _ in hooked} == set(OTHERS)


class _FailingDecode:
    """The real model, except that the batched decode forward raises."""

    def __init__(self, model, runner):
        self._model, self._runner = model, runner

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None):
        if cache is not None and any(cache is g for g in self._runner.batch.caches.groups):
            raise RuntimeError("injected decode fault")
        return self._model(inputs, cache=cache)


async def test_a_fault_of_the_batched_decode_ends_everyone_and_the_engine_says_so(
    tmp_path, model_cache_dir
):
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=8, event_log=log
    ) as engine:
        runner = engine.step_loop.runner
        runner.model = _FailingDecode(runner.model, runner)
        results = await run_together(engine, prompt_of(100, salt=9), params(seed=5))
        assert not engine.healthy
        assert engine.unhealthy_reason.startswith("executor failed")
        assert "injected decode fault" in engine.unhealthy_reason
        with pytest.raises(EngineDeadError, match="unhealthy"):
            await engine.submit("anyone?", params=params(1))
    for rid, outs in results.items():
        assert [o.finish_reason for o in outs if o.finish_reason] == ["error"], rid
    terminals = assert_one_terminal_each(log, ["doomed", *OTHERS])
    assert {t.reason for t in terminals if t.request_id in results} == {"error"}


async def test_a_cancel_that_lands_as_the_engine_closes_its_inbox_is_no_step_loop_failure(
    model_cache_dir,
):
    """A stream closed at exit sends a Cancel; the engine closes the step loop's inbox right
    after. The idle loop wakes with that message, not with its cancellation, then finds the
    inbox closed: that is the end of its work, not a failure that kills the engine."""
    async with Engine.open("stepline-demo", max_step_tokens=32) as engine:
        loop = engine.step_loop
        loop.inbox.send_nowait(Cancel(request_id="gone-already"))
        loop.inbox.close()  # as Engine.open's exit does, with no await in between
        # Every task waits: the loop has handled the message, found the inbox closed, ended.
        await anyio.wait_all_tasks_blocked()
        assert engine.healthy, engine.unhealthy_reason
        assert loop.dead_reason is None


async def test_a_bug_in_the_step_loop_is_not_reported_as_a_dead_executor(
    model_cache_dir, monkeypatch
):
    async with Engine.open("stepline-demo", max_step_tokens=16, max_num_seqs=4) as engine:
        loop = engine.step_loop
        stream = await engine.submit("hello", params=params(1, max_tokens=100))

        def broken(*args):
            raise KeyError("a bug in the commit")

        monkeypatch.setattr(loop.core, "update_from_output", broken)
        with anyio.fail_after(10):
            outs = await collect(stream)
        assert outs[-1].finish_reason == "error"
        assert not engine.healthy
        assert engine.unhealthy_reason.startswith("step loop failed")
        assert loop.executor.dead is None  # the executor did nothing wrong


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": 2**31},
        {"repetition_penalty": math.inf},
        {"repetition_penalty": 11.0},
        {"presence_penalty": math.nan},
        {"frequency_penalty": 2.5},
        {"temperature": math.inf},
        {"top_p": math.nan},
        {"min_p": math.nan},
        {"stop": ("",)},
        {"stop_token_ids": (-1,)},
    ],
)
def test_out_of_range_sampling_params_raise_value_error(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


async def test_values_past_the_vocabulary_are_refused_and_the_engine_serves_on(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        vocab = engine.vocab_size
        with pytest.raises(ValueError, match=f"vocabulary size \\({vocab}\\)"):
            await engine.submit("hi", params=SamplingParams(top_k=vocab + 1))
        with pytest.raises(ValueError, match=f"0..{vocab - 1}"):
            await engine.submit("hi", params=SamplingParams(stop_token_ids=(vocab,)))
        with pytest.raises(ValueError, match="top_k"):
            await engine.submit("hi", params=SamplingParams(top_k=2**31))
        ok = [
            SamplingParams(max_tokens=4, top_k=vocab, seed=1, ignore_eos=True),
            SamplingParams(max_tokens=4, top_k=-1, seed=1, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=1e-7, ignore_eos=True),
            SamplingParams(max_tokens=4, repetition_penalty=10.0, presence_penalty=2.0, seed=2),
        ]
        for p in ok:
            outs = await collect(await engine.submit("still serving", params=p))
            assert outs[-1].finish_reason in ("length", "stop")
        assert engine.healthy


async def test_params_that_skipped_validation_end_their_request_not_the_engine(model_cache_dir):
    # model_construct skips pydantic's checks: the executor's own RowSampling still refuses
    # the value, and that fault is pinned on the request.
    unchecked = SamplingParams.model_construct(
        **{**SamplingParams().model_dump(), "repetition_penalty": math.inf, "max_tokens": 4}
    )
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=4) as engine:
        other = await engine.submit("fine", params=params(1))
        outs = await collect(await engine.submit("bad", params=unchecked))
        assert outs[-1].finish_reason == "error" and outs[-1].error == ADMISSION_FAILED
        assert (await collect(other))[-1].finish_reason == "length"
        assert engine.healthy


async def test_with_a_key_health_says_what_broke_and_only_key_holders_get_the_detail(
    model_cache_dir,
):
    import httpx

    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pipeline.served import OneModel

    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=8) as engine:
        runner = engine.step_loop.runner
        runner.model = _FailingDecode(runner.model, runner)
        await run_together(engine, prompt_of(100, salt=9), params(seed=5))
        assert not engine.healthy
        async with serve_in_process(create_app(OneModel(engine), api_key="sk-ops")) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                anyone = await http.get("/health")
                ops = await http.get("/health", headers={"authorization": "Bearer sk-ops"})
    assert anyone.status_code == ops.status_code == 503
    assert anyone.json() == {
        "status": "unhealthy",
        "reason": "executor failed (send the API key for the detail)",
    }
    assert "injected decode fault" in ops.json()["reason"]
    assert ops.json()["reason"] == engine.unhealthy_reason
