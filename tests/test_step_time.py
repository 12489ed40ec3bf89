"""The step-time target in a running engine: the warm-up, and chunks sized by the cost model."""

from __future__ import annotations

import threading

import anyio
import httpx
from structlog.testing import capture_logs

from stepline.actors.scheduler import cost_model
from stepline.actors.scheduler.cost_model import CostModel, StepCost, StepFeatures
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.warmup import Warmup
from stepline.api import Engine, SamplingParams
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel
from stepline.engine.runner import ModelRunner
from stepline.events.log import read_events
from stepline.events.models import ChunkPrefilled, StepFinished, StepPlanned, TokensSampled

# Prefill costs 1 ms a token, a decode row 5 ms: a 100 ms step has room for ~90 prompt
# tokens beside one decode row.
KNOWN = StepCost(step=0.002, per_prefill_token=0.001, per_decode_row=0.005)


class FixedCost(CostModel):
    """A cost model that answers `cost` whatever the steps measure: a test of the policy's
    decisions feeds it the costs it needs, not this machine's (a step slowed by a busy
    machine made a learning model refit to the demo model's real, far smaller, costs)."""

    def __init__(self, cost: StepCost) -> None:
        super().__init__()
        self._fixed = cost

    @property
    def cost(self) -> StepCost:
        return self._fixed

    @property
    def last(self) -> StepCost:
        return self._fixed

    def observe(self, features: StepFeatures, seconds: float) -> None:
        pass  # measured times must not move it


def _prompt(n: int) -> list[int]:
    return [3 + (i * 37) % 250 for i in range(n)]


async def _warmed_up(engine: Engine) -> None:
    """Wait until the engine's warm-up (run while it idles) has measured every step."""
    with anyio.fail_after(120):
        await engine.step_loop.wait_until(lambda: not engine.warming_up)


async def test_the_warm_up_learns_a_cost_model_and_leaves_no_trace(tmp_path, demo, monkeypatch):
    monkeypatch.setenv("STEPLINE_CACHE_DIR", str(tmp_path / "cache"))  # no samples kept yet
    log = tmp_path / "run.jsonl"
    with capture_logs() as logs:
        opened = Engine.open(str(demo.path), max_step_tokens=64, max_num_seqs=4, event_log=log)
        async with opened as engine:
            assert engine.warming_up  # it serves before the warm-up has run
            await _warmed_up(engine)
            assert [e["event"] for e in logs if "warmup" in e["event"]] == [
                "warmup_pending",
                "warmup_measured",
            ]
            loop = engine.step_loop
            assert loop.cost_model is not None and loop.cost_model.cost is not None
            assert loop.runner.num_sequences == 0  # its requests are gone
            assert len(loop.runner.store) == 0  # and none went to the prefix cache
            assert loop.index.num_entries == 0
            assert engine.config["max_step_ms"] == 100.0
            params = SamplingParams(max_tokens=4)
            out = [o async for o in engine.generate(_prompt(40), params=params)]
            assert out[-1].finish_reason is not None
    finished = [e for e in read_events(log) if isinstance(e, StepFinished)]
    assert finished and not any(e.warming_up for e in finished)  # all after the warm-up
    assert all(e.step >= 1 and "warmup" not in str(e.request_id) for e in read_events(log))


async def test_requests_sent_during_the_warm_up_are_served_and_it_finishes_later(
    tmp_path, demo, monkeypatch
):
    monkeypatch.setenv("STEPLINE_CACHE_DIR", str(tmp_path / "cache"))
    # Each of two turns of the warm-up, once it has measured a step, waits until a request
    # is on its way (the HTTP server counts it as soon as its body is read): its next check
    # between steps sees it.
    stepped, sent = threading.Event(), threading.Event()
    real_run = Warmup.run
    stops = iter([True, True])

    def run(self, stop):
        checks = 0
        hold = next(stops, False)

        def checked() -> bool:
            nonlocal checks
            checks += 1
            if checks == 2 and hold:
                stepped.set()
                sent.wait(30)
            return stop()

        return real_run(self, checked)

    monkeypatch.setattr(Warmup, "run", run)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    log = tmp_path / "run.jsonl"
    with capture_logs() as logs:
        opened = Engine.open(str(demo.path), max_step_tokens=64, max_num_seqs=4, event_log=log)
        async with opened as engine:
            for n in (5, 70):
                await anyio.to_thread.run_sync(stepped.wait)
                stepped.clear()
                engine.arriving()
                sent.set()
                stream = await engine.submit(_prompt(n), params=params)
                sent.clear()
                out = [o async for o in stream]
                assert sum(len(o.token_ids) for o in out) == 6
                assert engine.warming_up  # the turn stopped for it, with steps left
            await _warmed_up(engine)
            loop = engine.step_loop
            assert loop.runner.num_sequences == 0
            assert loop.cost_model.cost is not None
    measured = [e for e in logs if e["event"] == "warmup_measured"]
    assert [(e["turns"], e["samples"]) for e in measured] == [(3, 12)]  # all, in 3 turns
    # the log says its steps ran while the engine was warming up
    steps = [e for e in read_events(log) if isinstance(e, StepFinished)]
    assert steps and all(e.warming_up for e in steps)
    assert len(list((tmp_path / "cache" / "warmup").iterdir())) == 1  # kept for next time


async def test_health_says_ok_at_once_and_warming_up_until_the_warm_up_is_done(
    tmp_path, demo, monkeypatch
):
    monkeypatch.setenv("STEPLINE_CACHE_DIR", str(tmp_path / "cache"))
    go = threading.Event()  # the warm-up (~50 ms on the demo) waits until health was asked
    real_run = Warmup.run
    monkeypatch.setattr(Warmup, "run", lambda self, stop: go.wait(30) and real_run(self, stop))
    async with Engine.open(str(demo.path), max_step_tokens=64) as engine:
        async with (
            serve_in_process(create_app(OneModel(engine))) as url,
            httpx.AsyncClient() as http,
        ):
            early = (await http.get(f"{url}/health")).json()
            go.set()
            await _warmed_up(engine)
            later = (await http.get(f"{url}/health")).json()
    assert early["status"] == "ok" and early["warming_up"] is True
    assert later["status"] == "ok" and "warming_up" not in later


def test_a_warm_up_stopped_between_steps_measures_what_an_unstopped_one_does(demo):
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4)
    whole = Warmup(ModelRunner(demo), config, 300, demo.max_context)
    whole.run()
    runner = ModelRunner(demo)
    stopped = Warmup(runner, config, 300, demo.max_context)
    checks = 0

    def every_third() -> bool:
        nonlocal checks
        checks += 1
        return checks % 3 == 0

    turns = 0
    while not stopped.done:
        stopped.run(every_third)
        turns += 1
        assert runner.num_sequences == 0  # a stopped turn frees what it admitted
    assert turns > 3
    assert [s.features for s in stopped.samples] == [s.features for s in whole.samples]
    assert len(whole.samples) >= 8  # enough for the cost model to fit


async def test_a_restart_seeds_its_cost_model_with_the_samples_measured_before(
    tmp_path, demo, monkeypatch
):
    monkeypatch.setenv("STEPLINE_CACHE_DIR", str(tmp_path / "cache"))
    costs, events = [], []
    for max_step_tokens in (64, 64, 128):
        with capture_logs() as logs:
            async with Engine.open(str(demo.path), max_step_tokens=max_step_tokens) as engine:
                await _warmed_up(engine)
                costs.append(engine.step_loop.cost_model.cost)
        events.append([e["event"] for e in logs if "warmup" in e["event"]])
    measured = ["warmup_pending", "warmup_measured"]
    assert events == [measured, ["warmup_samples_reused"], measured]
    assert costs[1] == costs[0]  # the same samples: the same fit
    # A kept file that is not what was written is measured again, never trusted.
    for kept in (tmp_path / "cache" / "warmup").iterdir():
        kept.write_text("{not json")
    with capture_logs() as logs:
        async with Engine.open(str(demo.path), max_step_tokens=64) as engine:
            await _warmed_up(engine)
    assert [e["event"] for e in logs if "warmup" in e["event"]] == measured


async def test_without_a_target_there_is_no_warm_up(model_cache_dir):
    async with Engine.open("stepline-demo", max_step_ms=None) as engine:
        assert engine.step_loop.cost_model is None


async def test_a_prompt_arriving_while_others_decode_gets_chunks_that_fit_the_target(
    tmp_path, model_cache_dir
):
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo",
        max_step_tokens=512,
        max_num_seqs=4,
        max_step_ms=100,
        event_log=log,
        prefix_cache_gb=0,
    ) as engine:
        engine.step_loop.cost_model = FixedCost(KNOWN)
        # Alone: nobody to protect, so the whole budget.
        alone = await engine.submit(_prompt(1200), params=SamplingParams(max_tokens=1))
        async for _ in alone:
            pass
        decoder = await engine.submit(
            _prompt(8), params=SamplingParams(max_tokens=10_000, ignore_eos=True)
        )
        decoding = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                async for _ in decoder:
                    decoding.set()

            tg.start_soon(consume)
            await decoding.wait()  # the late prompt meets a decoding request
            late = await engine.submit(_prompt(1200), params=SamplingParams(max_tokens=1))
            async for _ in late:
                pass
            await decoder.aclose()
            tg.cancel_scope.cancel()
    events = list(read_events(log))
    chunks = {
        rid: [
            e.end - e.start for e in events if isinstance(e, ChunkPrefilled) and e.request_id == rid
        ]
        for rid in (alone.request_id, late.request_id)
    }
    assert chunks[alone.request_id] == [512, 512, 176]
    decode_steps = {
        e.step
        for e in events
        if isinstance(e, TokensSampled) and decoder.request_id in e.request_ids
    }
    late_chunks = [
        e.end - e.start
        for e in events
        if isinstance(e, ChunkPrefilled)
        and e.request_id == late.request_id
        and e.step in decode_steps
    ]
    # 2 ms + 5 ms (one decode row) of overheads are 15% of a 46.7 ms step, well within the
    # 100 ms target: 39 tokens at 1 ms each (a longer step would stall the decoder for
    # little gain: policy.PREFILL_SHARE)
    assert late_chunks and max(late_chunks) == 39
    assert sum(chunks[late.request_id]) == 1200
    # The log's steps say what sized each chunk: the budget, then the prompt's end, while
    # alone; the time target beside the decoder.
    limits = {
        rid: [
            limit
            for e in events
            if isinstance(e, StepPlanned)
            for r, limit in zip(e.request_ids, e.limits, strict=True)
            if r == rid
        ]
        for rid in (alone.request_id, late.request_id)
    }
    assert limits[alone.request_id] == ["budget", "budget", "prompt-end"]
    assert limits[late.request_id][:-1] == ["time"] * (len(limits[late.request_id]) - 1)
    # ... and each step's end what the host was doing: the process's CPU share of it, the
    # machine's load (not this run's figures: that they are there)
    finished = [e for e in events if isinstance(e, StepFinished)]
    assert finished and all(e.cpu_share is not None and e.cpu_share >= 0 for e in finished)
    assert all(e.load_avg is not None and e.load_avg >= 0 for e in finished)


async def test_steps_that_only_decode_never_refit_the_cost_model(monkeypatch, model_cache_dir):
    # A refit is ~3 ms of numpy on the step loop: a steady decode must not pay it every
    # 16 steps. It refits once a chunk is to be sized again, with everything it saw since.
    fits: list[int] = []
    real_fit = cost_model.fit
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        loop = engine.step_loop
        monkeypatch.setattr(
            cost_model, "fit", lambda samples: fits.append(loop.step + 1) or real_fit(samples)
        )
        first = loop.step + 1  # the prompt's one chunk
        params = SamplingParams(max_tokens=80, ignore_eos=True)
        async for _ in engine.generate(_prompt(8), params=params):
            pass
        decoded = loop.step
        async for _ in engine.generate(_prompt(8), params=SamplingParams(max_tokens=1)):
            pass
    assert decoded - first >= 79
    assert [step for step in fits if first < step <= decoded] == []  # none while it decoded
    assert fits[-1] == decoded + 1  # the next prompt's step refits
