"""Engine benchmark (issue 2): stepline's engine vs mlx-lm on the same model and workload.

    .venv/bin/python benchmarks/engine_bench.py                  # full run
    .venv/bin/python benchmarks/engine_bench.py --quick          # ~25 s smoke run
    .venv/bin/python benchmarks/engine_bench.py --json out.json  # also write every figure

Four measurements, each repeated `--repeats` times (median reported). Within a repeat the
systems being compared run back to back, and every ratio is the median of those paired,
per-repeat ratios, so that load drifting on a shared machine cancels as far as it can. Each
measurement also records how many cores other processes kept busy meanwhile, and is taken
again (`--retries`) while that exceeds `--max-foreign-cores`: on 2 cores, one busy neighbour
slows OpenBLAS-threaded MLX by 10-50x. Every repeat uses freshly opened engines and fresh
random prompts (no prefix-cache hits).

1. Head-of-line: 4 requests decode; once they are steady a long prompt arrives. The long
   request's TTFT, and the decoders' inter-token latency (ITL) inside the prefill window
   (an interval that overlaps [arrival, long request's first token]) and outside it; the
   longest ITL inside is the decoders' longest stall. stepline with `--max-step-tokens`
   (512) and its step-time target (`--max-step-ms`, default 100), and the same engine
   without the target (tokens only), vs mlx-lm's `BatchGenerator` with `prefill_step_size`
   2048 (its default), 512 and 256 (each `next()` is one decode step plus one prefill chunk
   of that size); each figure is compared with the best BatchGenerator configuration for
   that figure. BatchGenerator token times are the returns of `next()`.
2. Decode throughput at batch 1, 8, 32 (greedy, ignore_eos, steady state: from the moment
   every request has `warm` tokens to the first request's last token) vs a bare mlx-lm loop
   over the same merged `BatchKVCache` (the limit) and vs BatchGenerator.
3. Event-log cost: stepline's batch-8 throughput with the event log on vs off.
4. OpenBLAS: prefill tokens/s of one prompt with and without the preload, each in a fresh
   subprocess (the preload must precede `import mlx`): STEPLINE_NO_OPENBLAS=1 turns it off;
   a third variant pins OpenBLAS to one thread (OPENBLAS_NUM_THREADS=1).

5. The engine's own Python per token (`--sections host`): the same decode workload at batch
   1, 8 and 32 with the event log on, against a runner that returns every token at once
   (run on the executor thread, as a model's is): the event loop's and the log writer's
   CPU per token, with no forward competing for the cores. It changes only with the
   engine's code, where the figures beside a model move by 10-30% between runs on 2 cores.

A profile pass (stepline at batch 8 and 32, instrumented) splits a decode step's wall time
into the executor's `runner.run` (forward, sampling) and the asyncio side (schedule, events,
request actors, the thread hop), next to the bare loop's step time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import stepline.engine  # noqa: F401 - loads OpenBLAS; must precede the first `import mlx`

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from stepline.actors.scheduler.work import StepResult
from stepline.api import Engine, SamplingParams
from stepline.api.engine import run as engine_run
from stepline.engine import _blas, step_sampling
from stepline.engine.models import load_model
from stepline.engine.sampling import PendingSample

DEFAULT_MODEL = "stepline-demo-large"
EVENT_LOG_PAIRS = 2  # on/off pairs per repeat: the difference sought is small
NUM_DECODERS = 4  # head-of-line: requests decoding when the long prompt arrives
DECODER_MAX_TOKENS = 2048  # head-of-line decoders: more than they get to make; then cancelled
FIRST_TOKEN_ID = 3  # the demo tokenizers' ids 0..2 are special tokens
HOST_TOKENS = 512  # tokens a request in the host section


@dataclass(frozen=True)
class Workload:
    repeats: int = 3
    max_step_tokens: int = 512  # stepline's token budget per step
    max_step_ms: float | None = 100.0  # stepline's step-time target (None: tokens only)
    bg_prefill_step: int = 2048  # BatchGenerator's prefill_step_size (its default): decode
    bg_hol_steps: tuple[int, ...] = (2048, 512, 256)  # head-of-line: each of these
    hol_cap: int | None = None  # also run head-of-line with this long_prefill_cap (None: skip)
    short_prompt: int = 32  # decoders' prompt tokens
    long_prompt: int = 4000  # head-of-line: the prompt that arrives
    warm_tokens: int = 8  # tokens each request makes before anything is measured
    after_tokens: int = 8  # head-of-line: decoder tokens after the long request's first
    batches: tuple[int, ...] = (1, 8, 32)
    decode_tokens: int = 128  # measured decode steps per request (after warm_tokens)
    event_log_batch: int = 8
    blas_prompt: int = 512  # OpenBLAS section; the reference BLAS does ~40 tokens/s here
    profile: bool = True
    sections: tuple[str, ...] = ("hol", "decode", "event_log", "host", "blas")
    max_foreign_cores: float = 0.25  # measure again while other processes keep more busy
    retries: int = 2


QUICK = Workload(
    repeats=1,
    long_prompt=1000,
    warm_tokens=4,
    after_tokens=4,
    batches=(1, 8),
    decode_tokens=16,
    blas_prompt=128,
)


# -- small helpers ---------------------------------------------------------------------------


_PROMPTS = random.Random(0)  # one stream for the whole run: no two prompts share a prefix


def make_prompt(num_tokens: int, vocab: int) -> list[int]:
    """A fresh random prompt: never a prefix-cache hit, so every run prefills in full."""
    return [_PROMPTS.randrange(FIRST_TOKEN_ID, vocab) for _ in range(num_tokens)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]  # drop nan
    return statistics.median(values) if values else float("nan")


def split_itl(
    times: Sequence[float], start: int, window: tuple[float, float], tol: float = 1e-3
) -> tuple[list[float], list[float]]:
    """(inside, outside) inter-token intervals of one request's token `times`, from index
    `start` on. An interval is inside when it overlaps the window; `tol` keeps the interval
    that starts with the long request's own final step (its tokens land microseconds apart)
    outside."""
    t_arrive, t_first = window
    inside: list[float] = []
    outside: list[float] = []
    for k in range(max(start, 1), len(times)):
        gap = times[k] - times[k - 1]
        overlaps = times[k] > t_arrive and times[k - 1] < t_first - tol
        (inside if overlaps else outside).append(gap)
    return inside, outside


def steady_throughput(times: Sequence[Sequence[float]], warm: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) from the moment every request has `warm` tokens to the
    first request's last token."""
    t0 = max(ts[warm - 1] for ts in times)
    t1 = min(ts[-1] for ts in times)
    n = sum(1 for ts in times for t in ts if t0 < t <= t1)
    return (n / (t1 - t0) if t1 > t0 else float("nan")), n, t1 - t0


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks() -> tuple[int, int]:
    """(CPU ticks every process has been busy, ticks of this one and its waited-for children)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return busy, sum(int(x) for x in own[11:15])  # utime, stime, cutime, cstime


class CpuMeter:
    """How many cores *other* processes kept busy while a measurement ran (Linux only;
    nan elsewhere): on a shared machine, the figure to read the others against."""

    def __enter__(self) -> CpuMeter:
        self.foreign_cores = float("nan")
        try:
            self._start = (time.perf_counter(), *_busy_ticks())
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is None:
            return
        t0, busy0, own0 = self._start
        busy1, own1 = _busy_ticks()
        seconds = time.perf_counter() - t0
        self.foreign_cores = max(0, (busy1 - busy0) - (own1 - own0)) / _TICK / seconds


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id (Linux only): to the
    nanosecond for Python's threads (their CPU clocks), to the scheduler tick (/proc) for
    the others (MLX's stream thread, OpenBLAS's workers)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    for thread in threading.enumerate():
        if thread.native_id in out and thread.ident is not None:
            with contextlib.suppress(OSError):  # it ended meanwhile
                out[thread.native_id] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return out


# -- stepline --------------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


class TokenTimes:
    """Arrival times of each stream's tokens, as its client sees them."""

    def __init__(self, n: int):
        self.times: list[list[float]] = [[] for _ in range(n)]
        self._changed = asyncio.Event()

    async def consume(self, i: int, stream: Any, stop: asyncio.Event | None = None) -> None:
        async with stream:
            async for out in stream:
                if out.token_ids:
                    self.times[i].append(time.perf_counter())
                    self._changed.set()
                if stop is not None and stop.is_set():
                    break  # leaving the loop cancels the request

    async def wait_until(self, pred: Callable[[], bool]) -> None:
        while not pred():
            self._changed.clear()
            await self._changed.wait()


class StepMarks:
    """Wall-clock end of every step, through the step loop's inspection hook."""

    def __init__(self, engine: Engine):
        self.ends: list[float] = []
        self._loop = engine.step_loop

    def __enter__(self) -> StepMarks:
        self._loop.on_step = lambda _: self.ends.append(time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.on_step = None

    def count(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.ends if t0 < t <= t1)


async def hol_stepline(engine: Engine, w: Workload, vocab: int) -> dict:
    decoders = [make_prompt(w.short_prompt, vocab) for i in range(NUM_DECODERS)]
    long_prompt = make_prompt(w.long_prompt, vocab)
    tt = TokenTimes(NUM_DECODERS + 1)
    stop = asyncio.Event()
    with StepMarks(engine) as marks:
        tasks = []
        for i, p in enumerate(decoders):
            stream = await engine.submit(p, params=greedy(DECODER_MAX_TOKENS))
            tasks.append(asyncio.create_task(tt.consume(i, stream, stop)))
        await tt.wait_until(lambda: all(len(t) >= w.warm_tokens for t in tt.times[:-1]))
        t_arrive = time.perf_counter()
        stream = await engine.submit(long_prompt, params=greedy(1))
        tasks.append(asyncio.create_task(tt.consume(NUM_DECODERS, stream)))
        await tt.wait_until(lambda: bool(tt.times[-1]))
        t_first = tt.times[-1][0]
        counts = [len(t) for t in tt.times[:-1]]
        await tt.wait_until(
            lambda: all(
                len(t) >= c + w.after_tokens for t, c in zip(tt.times, counts, strict=False)
            )
        )
        stop.set()
        await asyncio.gather(*tasks)
    return _hol_figures(
        tt.times[:-1], w.warm_tokens, (t_arrive, t_first), steps=marks.count(t_arrive, t_first)
    )


def _hol_figures(
    decoder_times: list[list[float]], warm: int, window: tuple[float, float], steps: int
) -> dict:
    inside: list[float] = []
    outside: list[float] = []
    for times in decoder_times:
        i, o = split_itl(times, warm, window)
        inside += i
        outside += o
    return {
        "ttft_s": window[1] - window[0],
        "itl_inside_p50_ms": 1e3 * percentile(inside, 50),
        "itl_inside_p99_ms": 1e3 * percentile(inside, 99),
        "itl_inside_max_ms": 1e3 * max(inside, default=float("nan")),
        "itl_outside_p50_ms": 1e3 * percentile(outside, 50),
        "itl_outside_p99_ms": 1e3 * percentile(outside, 99),
        "num_inside": len(inside),
        "num_outside": len(outside),
        "steps_in_window": steps,
    }


async def stream_batch(
    engine: Engine, batch: int, max_tokens: int, w: Workload, vocab: int
) -> TokenTimes:
    """`batch` greedy requests of `max_tokens` tokens each, read to the end as they stream:
    each token's arrival time."""
    tt = TokenTimes(batch)
    tasks = []
    for i in range(batch):
        prompt = make_prompt(w.short_prompt, vocab)
        stream = await engine.submit(prompt, params=greedy(max_tokens))
        tasks.append(asyncio.create_task(tt.consume(i, stream)))
    await asyncio.gather(*tasks)
    return tt


async def decode_stepline(engine: Engine, batch: int, w: Workload, vocab: int) -> dict:
    with StepMarks(engine) as marks:
        tt = await stream_batch(engine, batch, w.warm_tokens + w.decode_tokens, w, vocab)
    tps, n, seconds = steady_throughput(tt.times, w.warm_tokens)
    t0 = max(ts[w.warm_tokens - 1] for ts in tt.times)
    ends = [t for t in marks.ends if t0 <= t <= t0 + seconds]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "tokens_per_s": tps,
        "tokens": n,
        "seconds": seconds,
        "step_ms": 1e3 * seconds / len(ends) if ends else float("nan"),
        "step_ms_median": 1e3 * median(gaps),
    }


# -- the engine's own Python: a runner without a model ----------------------------------------


class InstantRunner:
    """Stands in for the model runner: every decode row and final chunk gets its token at
    once (ids cycling over a few hundred, so the detokenizers decode real text). The
    executor thread still runs it; what is left of a step is the engine's own work."""

    def __init__(self, vocab: int) -> None:
        self._ids = list(range(FIRST_TOKEN_ID, min(vocab, FIRST_TOKEN_ID + 300)))
        self._next = 0

    def run(self, work: Any) -> Any:
        plan = work.plan
        rows = [*plan.decodes, *(c.request_id for c in plan.chunks if c.is_final)]
        ids, start = self._ids, self._next
        self._next = (start + len(rows)) % len(ids)
        tokens = {rid: ids[(start + i) % len(ids)] for i, rid in enumerate(rows)}
        return StepResult(tokens=tokens, seconds=1e-3)

    def housekeep(self, chores: Any) -> Any:
        return StepResult()


async def host_stepline(engine: Engine, batch: int, w: Workload, vocab: int) -> dict:
    """`batch` requests of `w.decode_tokens` tokens against `InstantRunner`: the event
    loop's and the event log writer's CPU per token (their CPU clocks)."""
    loop = engine.step_loop
    real, loop.runner = loop.runner, InstantRunner(vocab)
    try:
        cpu0, t0 = thread_cpu_seconds(), time.perf_counter()
        tt = await stream_batch(engine, batch, HOST_TOKENS, w, vocab)
        await loop.wait_until(lambda: loop.settled)  # every end freed (on this runner)
        cpu = cpu_by_kind(cpu0, thread_cpu_seconds())
        seconds = time.perf_counter() - t0
    finally:
        loop.runner = real
    tokens = sum(len(t) for t in tt.times)
    loop_cpu = cpu.get("asyncio", 0.0)
    return {
        "batch": batch,
        "host_us_per_token": 1e6 * (loop_cpu + cpu.get("event-log", 0.0)) / tokens,
        "loop_us_per_token": 1e6 * loop_cpu / tokens,
        "tokens_per_s": tokens / seconds,
    }


# -- mlx-lm ----------------------------------------------------------------------------------


def hol_batchgen(model: Any, w: Workload, vocab: int, prefill_step: int) -> dict:
    decoders = [make_prompt(w.short_prompt, vocab) for i in range(NUM_DECODERS)]
    long_prompt = make_prompt(w.long_prompt, vocab)
    gen = BatchGenerator(model, prefill_step_size=prefill_step)  # no stop tokens
    try:
        uids = gen.insert(decoders, max_tokens=[DECODER_MAX_TOKENS] * NUM_DECODERS)
        times: dict[int, list[float]] = {u: [] for u in uids}

        def step() -> list[Any]:
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                times.setdefault(r.uid, []).append(now)
            return responses

        while any(len(times[u]) < w.warm_tokens for u in uids):
            step()
        t_arrive = time.perf_counter()
        (long_uid,) = gen.insert([long_prompt], max_tokens=[1])
        steps = 0
        while not times.get(long_uid):
            step()
            steps += 1
        t_first = times[long_uid][0]
        counts = {u: len(times[u]) for u in uids}
        while any(len(times[u]) < counts[u] + w.after_tokens for u in uids):
            step()
        gen.remove(uids)
    finally:
        gen.close()
    return _hol_figures([times[u] for u in uids], w.warm_tokens, (t_arrive, t_first), steps)


def decode_batchgen(model: Any, batch: int, w: Workload, vocab: int) -> dict:
    prompts = [make_prompt(w.short_prompt, vocab) for _ in range(batch)]
    gen = BatchGenerator(model, prefill_step_size=w.bg_prefill_step, completion_batch_size=batch)
    try:
        uids = gen.insert(prompts, max_tokens=[w.warm_tokens + w.decode_tokens] * batch)
        times: dict[int, list[float]] = {u: [] for u in uids}
        done = 0
        while done < batch:
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                times[r.uid].append(now)
                done += r.finish_reason is not None
    finally:
        gen.close()
    tps, n, seconds = steady_throughput(list(times.values()), w.warm_tokens)
    return {"tokens_per_s": tps, "tokens": n, "seconds": seconds}


def decode_bare(model: Any, batch: int, w: Workload, vocab: int) -> dict:
    """The limit: per-request prefill, caches merged as the engine merges them, then
    `model -> argmax -> eval` and nothing else per step."""
    caches, first = [], []
    for _ in range(batch):
        prompt = make_prompt(w.short_prompt, vocab)
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=cache)
        first.append(mx.argmax(logits[:, -1, :], axis=-1))
        caches.append(cache)
    cache = [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]
    tokens = mx.concatenate(first)[:, None]
    mx.eval(tokens, [c.state for c in cache])

    def run(num_steps: int) -> float:
        nonlocal tokens
        t0 = time.perf_counter()
        for _ in range(num_steps):
            logits = model(tokens, cache=cache)
            tokens = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
            mx.eval(tokens)
        return time.perf_counter() - t0

    run(w.warm_tokens - 1)
    seconds = run(w.decode_tokens)
    return {
        "tokens_per_s": batch * w.decode_tokens / seconds,
        "tokens": batch * w.decode_tokens,
        "seconds": seconds,
        "step_ms": 1e3 * seconds / w.decode_tokens,
    }


# -- profile: where a stepline decode step goes -----------------------------------------------


class PerStep:
    """Seconds spent in some calls during each `runner.run` (0 for a step that made none);
    a call made inside another one timed here counts once."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._depth = 0

    def begin_step(self) -> None:
        self.steps.append(0.0)

    def timed(self, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0 and self.steps:
                    self.steps[-1] += time.perf_counter() - t0

        return wrapper


class _EvalForward:
    """Stands in for the model in the runner: evaluates each forward on the spot, so that
    the forward's compute is timed apart from sampling (profile only: one extra sync)."""

    def __init__(self, model: Any, seconds: PerStep):
        self._model = model
        self._call = seconds.timed(self._eval)

    def _eval(self, *args: Any, **kwargs: Any) -> Any:
        out = self._model(*args, **kwargs)
        mx.eval(out)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _timed(fn: Callable, into: list[float]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def _timed_async(fn: Callable, into: list[float]) -> Callable:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


# what `instrumented` times
TIMED = ("executor_call", "commit", "deliver", "run")  # one call per step each
PER_STEP = ("forward", "sampler")  # any number of calls per step, summed


@contextlib.contextmanager
def instrumented(engine: Engine, cpu_at: tuple[int, int]):
    """Time, per step: the executor round trip and the commit (events, then telling the
    request actors) on the asyncio side; runner.run, the forward and the sampler on the
    executor thread. Each forward is evaluated where it is built, so the runner's look-ahead
    overlaps nothing while profiling (nor does a pipelined step's next forward). Also
    snapshot every thread's CPU time as steps `cpu_at` begin (into `timings["cpu"]`).
    Patches this engine's attributes (its core's `update_from_output` among them) and the
    sampling functions, and restores them."""
    loop, runner = engine.step_loop, engine.step_loop.runner
    timings: dict[str, Any] = {k: [] for k in TIMED}
    timings["cpu"] = []
    run = runner.run

    per_step = {k: PerStep() for k in PER_STEP}
    timings.update((k, t.steps) for k, t in per_step.items())

    def run_with_cpu(*args: Any) -> Any:
        for t in per_step.values():
            t.begin_step()
        if len(timings["run"]) in cpu_at:
            timings["cpu"].append(thread_cpu_seconds())
        return run(*args)

    saved = [
        (loop, "_run_executor", loop._run_executor),
        (loop.core, "update_from_output", loop.core.update_from_output),
        (loop, "_deliver", loop._deliver),
        (runner, "run", runner.run),
        (step_sampling, "sample_step", step_sampling.sample_step),
        (step_sampling, "sample_ahead", step_sampling.sample_ahead),
        (PendingSample, "finish", PendingSample.finish),
        (runner, "model", runner.model),
    ]
    loop._run_executor = _timed_async(loop._run_executor, timings["executor_call"])
    loop.core.update_from_output = _timed(loop.core.update_from_output, timings["commit"])
    loop._deliver = _timed(loop._deliver, timings["deliver"])
    runner.run = _timed(run_with_cpu, timings["run"])
    # A step samples its final chunks, then takes the samples made a step ahead for its
    # batch; a pipelined step only reads those (`PendingSample.finish`).
    sampler = per_step["sampler"]
    step_sampling.sample_step = sampler.timed(step_sampling.sample_step)
    step_sampling.sample_ahead = sampler.timed(step_sampling.sample_ahead)
    PendingSample.finish = sampler.timed(PendingSample.finish)  # type: ignore[method-assign]
    runner.model = _EvalForward(runner.model, per_step["forward"])
    try:
        yield timings
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def cpu_by_kind(cpu0: dict[int, float], cpu1: dict[int, float]) -> dict[str, float]:
    """CPU seconds each kind of thread used between two `thread_cpu_seconds` snapshots."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    for tid, seconds in cpu1.items():
        kind = _thread_kind(tid, names)
        out[kind] = out.get(kind, 0.0) + seconds - cpu0.get(tid, 0.0)
    return out


def _thread_kind(native_id: int, names: dict[int, str]) -> str:
    name = names.get(native_id)
    if name is None:
        return "native"  # MLX's stream thread, OpenBLAS's workers
    return {"MainThread": "asyncio"}.get(name, name.removeprefix("stepline-"))


async def profile_stepline(engine: Engine, batch: int, w: Workload, vocab: int) -> dict:
    # Steady steps: decode only, every row present (admission takes a step or two).
    first, last = w.warm_tokens + 2, w.warm_tokens + w.decode_tokens - 2
    with instrumented(engine, cpu_at=(first, last)) as timings:
        figures = await decode_stepline(engine, batch, w, vocab)
    cpu_ms: dict[str, float] = {}
    if len(timings["cpu"]) == 2:
        used = cpu_by_kind(*timings["cpu"])
        cpu_ms = {kind: 1e3 * seconds / (last - first) for kind, seconds in used.items()}
    ms = {k: 1e3 * median(timings[k][first:last]) for k in TIMED + PER_STEP}
    wall = figures["step_ms_median"]
    host = sum(v for k, v in cpu_ms.items() if k in ("asyncio", "event-log"))
    return {
        "batch": batch,
        "host_us_per_token": 1e3 * host / batch,
        "step_wall_ms": wall,
        "runner_run_ms": ms["run"],
        "forward_ms": ms["forward"],
        "sampler_ms": ms["sampler"],
        "runner_other_ms": ms["run"] - ms["forward"] - ms["sampler"],
        "executor_hop_ms": ms["executor_call"] - ms["run"],
        "commit_ms": ms["commit"] + ms["deliver"],
        "loop_other_ms": wall - ms["executor_call"] - ms["commit"] - ms["deliver"],
        "cpu_ms_per_step": {k: v for k, v in cpu_ms.items() if v >= 0.01},
    }


# -- OpenBLAS: one fresh process per variant ---------------------------------------------------


REFERENCE_BLAS = "reference BLAS (STEPLINE_NO_OPENBLAS=1)"
BLAS_VARIANTS: dict[str, dict[str, str]] = {
    "OpenBLAS preloaded (the default)": {},
    "OpenBLAS preloaded, OPENBLAS_NUM_THREADS=1": {"OPENBLAS_NUM_THREADS": "1"},
    REFERENCE_BLAS: {"STEPLINE_NO_OPENBLAS": "1"},
}


def blas_worker(model_name: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """Prefill one prompt (and decode a few tokens at batch 1) in this process."""
    model = load_model(model_name).model
    vocab = model.args.vocab_size
    warm = make_prompt(16, vocab)
    mx.eval(model(mx.array(warm)[None], cache=make_prompt_cache(model)))
    prompt = mx.array(make_prompt(prompt_tokens, vocab))[None]
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(prompt, cache=cache)
    mx.eval(logits, [c.state for c in cache])
    prefill_s = time.perf_counter() - t0
    token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.eval(token)
    decode_s = time.perf_counter() - t0
    path, reason = _blas.status()
    return {
        "prefill_tokens_per_s": prompt_tokens / prefill_s,
        "decode_b1_tokens_per_s": decode_tokens / decode_s,
        "openblas": path,
        "openblas_status": reason,
    }


def run_blas_variant(model_name: str, w: Workload, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("STEPLINE_NO_OPENBLAS",)}
    env.update(env_extra)
    cmd = [
        sys.executable,
        __file__,
        "--blas-worker",
        "--model",
        model_name,
        "--blas-prompt",
        str(w.blas_prompt),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"OpenBLAS worker failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the run ---------------------------------------------------------------------------------


def log_size(folder: Path) -> int:
    """Bytes of every event log written under `folder`."""
    return sum(p.stat().st_size for p in folder.glob("events*.jsonl"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {loadavg():.1f}] {msg}", file=sys.stderr, flush=True)


class Measure:
    """Runs one measurement; runs it again (up to `retries` times) while other processes keep
    more than `max_foreign_cores` busy, and keeps the least disturbed run."""

    def __init__(self, w: Workload):
        self.max_foreign = w.max_foreign_cores
        self.attempts = 1 + w.retries

    def _better(self, best: dict | None, figures: dict, meter: CpuMeter, attempt: int) -> dict:
        figures = {**figures, "foreign_cores": meter.foreign_cores, "attempts": attempt}
        if best is None or meter.foreign_cores < best["foreign_cores"]:
            return figures
        return best

    def _again(self, meter: CpuMeter, attempt: int) -> bool:
        again = meter.foreign_cores > self.max_foreign and attempt < self.attempts
        if again:
            log(f"  other processes kept {meter.foreign_cores:.2f} cores busy: measuring again")
        return again

    def run(self, fn: Callable[..., dict], *args: Any) -> dict:
        best = None
        for attempt in range(1, self.attempts + 1):
            with CpuMeter() as meter:
                figures = fn(*args)
            best = self._better(best, figures, meter, attempt)
            if not self._again(meter, attempt):
                break
        assert best is not None
        return best

    async def arun(self, fn: Callable[..., Any], *args: Any) -> dict:
        best = None
        for attempt in range(1, self.attempts + 1):
            with CpuMeter() as meter:
                figures = await fn(*args)
            best = self._better(best, figures, meter, attempt)
            if not self._again(meter, attempt):
                break
        assert best is not None
        return best


@contextlib.asynccontextmanager
async def fresh_engines(model_name: str, w: Workload, vocab: int, **variants: dict):
    """One warmed-up engine per variant (keyword arguments to Engine.open), all closed on
    exit. Fresh for each repeat: the step loop keeps every finished request's state, and a
    long history slows every step (see the profile), which is not what is measured here."""
    opts = {
        "max_step_tokens": w.max_step_tokens,
        "max_num_seqs": 32,
        "max_step_ms": w.max_step_ms,
    }
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for name, extra in variants.items():
            engines[name] = await stack.enter_async_context(
                Engine.open(model_name, **{**opts, **extra})
            )
            # Warm-up: first calls allocate and build what later ones reuse.
            await decode_stepline(engines[name], 2, replace(w, decode_tokens=4), vocab)
        yield engines


async def run_all(model_name: str, w: Workload) -> dict:
    model = load_model(model_name).model  # the mlx-lm side's copy, used on this thread
    vocab = model.args.vocab_size
    raw: dict[str, Any] = {
        "hol": {
            "stepline": [],
            "stepline_tokens_only": [],
            "stepline_cap": [],
            "batchgen": {str(n): [] for n in w.bg_hol_steps},
        },
        "decode": {str(b): {"stepline": [], "bare": [], "batchgen": []} for b in w.batches},
        "event_log": {"off": [], "on": []},
        "blas": {name: [] for name in BLAS_VARIANTS},
        "profile": [],
        "host": {str(b): [] for b in w.batches},
    }
    m = Measure(w)
    decode_bare(model, 2, replace(w, decode_tokens=4), vocab)  # warm-up
    decode_batchgen(model, 2, replace(w, decode_tokens=4), vocab)
    hol_variants: dict[str, dict] = {"engine": {}}
    if "hol" not in w.sections:
        pass
    elif w.max_step_ms is not None:
        hol_variants["tokens_only"] = {"max_step_ms": None}
    if w.hol_cap is not None and "hol" in w.sections:
        hol_variants["capped"] = {"long_prefill_cap": w.hol_cap}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(w.repeats):
            async with fresh_engines(model_name, w, vocab, **hol_variants) as engines:
                engine = engines["engine"]
                raw["engine_config"] = engine.config
                hol = raw["hol"]
                if "hol" in w.sections:
                    log(f"repeat {rep + 1}/{w.repeats}: head-of-line")
                    hol["stepline"].append(await m.arun(hol_stepline, engine, w, vocab))
                for n in w.bg_hol_steps if "hol" in w.sections else ():
                    hol["batchgen"][str(n)].append(m.run(hol_batchgen, model, w, vocab, n))
                if "tokens_only" in engines:
                    hol["stepline_tokens_only"].append(
                        await m.arun(hol_stepline, engines["tokens_only"], w, vocab)
                    )
                if "capped" in engines:
                    hol["stepline_cap"].append(
                        await m.arun(hol_stepline, engines["capped"], w, vocab)
                    )
                for b in w.batches if "decode" in w.sections else ():
                    log(f"repeat {rep + 1}/{w.repeats}: decode batch {b}")
                    d = raw["decode"][str(b)]
                    d["stepline"].append(await m.arun(decode_stepline, engine, b, w, vocab))
                    d["bare"].append(m.run(decode_bare, model, b, w, vocab))
                    d["batchgen"].append(m.run(decode_batchgen, model, b, w, vocab))
            if "event_log" not in w.sections:
                continue
            log(f"repeat {rep + 1}/{w.repeats}: event log")
            log_path = Path(tmp) / f"events-{rep}.jsonl"
            pair = {"off": {}, "on": {"event_log": log_path}}
            async with fresh_engines(model_name, w, vocab, **pair) as engines:
                for k in range(EVENT_LOG_PAIRS):
                    order = ["off", "on"] if (rep + k) % 2 == 0 else ["on", "off"]
                    for side in order:  # alternating: neither side always runs second
                        raw["event_log"][side].append(
                            await m.arun(
                                decode_stepline, engines[side], w.event_log_batch, w, vocab
                            )
                        )
        if w.profile:
            log_path = Path(tmp) / "events-profile.jsonl"
            pair = {"off": {}, "on": {"event_log": log_path}}
            async with fresh_engines(model_name, w, vocab, **pair) as engines:
                await _profile(engines, w, vocab, raw, m)
        if "host" in w.sections:
            log_path = Path(tmp) / "events-host.jsonl"
            async with fresh_engines(model_name, w, vocab, on={"event_log": log_path}) as engines:
                for rep in range(w.repeats):
                    for b in w.batches:
                        log(f"repeat {rep + 1}/{w.repeats}: host, batch {b}")
                        raw["host"][str(b)].append(
                            await m.arun(host_stepline, engines["on"], b, w, vocab)
                        )
        raw["event_log_bytes"] = log_size(Path(tmp))
    for rep in range(w.repeats if "blas" in w.sections else 0):
        for name, env in BLAS_VARIANTS.items():
            log(f"repeat {rep + 1}/{w.repeats}: BLAS {name}")
            raw["blas"][name].append(m.run(run_blas_variant, model_name, w, env))
    return raw


async def _profile(engines: dict[str, Engine], w: Workload, vocab: int, raw: dict, m: Measure):
    runs = [(b, "off") for b in w.batches if b in (8, 32)]
    runs += [(b, "on") for b in sorted({w.event_log_batch, *w.batches} & {8, 32})]
    for b, event_log in runs:
        log(f"profile batch {b}, event log {event_log} ({w.repeats} runs)")
        try:
            profs = [
                await m.arun(profile_stepline, engines[event_log], b, w, vocab)
                for _ in range(w.repeats)
            ]
        except AttributeError as exc:  # the engine's internals moved: report the rest
            log(f"profile skipped: {exc!r}")
            return
        prof = _median_profile(profs)
        bare = raw["decode"].get(str(b), {}).get("bare", [])
        prof["bare_step_ms"] = median([r["step_ms"] for r in bare])
        prof["event_log"] = event_log
        raw["profile"].append(prof)


def _median_profile(profs: list[dict]) -> dict:
    """Each figure's median over the profile's runs (its last run's other fields)."""
    out = dict(profs[-1])
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = median([p[key] for p in profs])
    threads = {k for p in profs for k in p["cpu_ms_per_step"]}
    out["cpu_ms_per_step"] = {
        k: median([p["cpu_ms_per_step"].get(k, 0.0) for p in profs]) for k in sorted(threads)
    }
    out["host_us_per_token_runs"] = [p["host_us_per_token"] for p in profs]
    return out


def paired(a: list[dict], b: list[dict], key: str, key_b: str | None = None) -> float:
    """Median over repeats of a[i][key] / b[i][key_b]."""
    return median([x[key] / y[key_b or key] for x, y in zip(a, b, strict=True)])


def _med(rows: list[dict], key: str) -> float:
    return median([r[key] for r in rows])


def _foreign(rows: list[dict]) -> dict:
    values = [r["foreign_cores"] for r in rows if r.get("foreign_cores") == r.get("foreign_cores")]
    return {"median": median(values), "max": max(values, default=float("nan"))}


HOL_SYSTEMS = {  # raw["hol"] key -> column label
    "stepline": "stepline",
    "stepline_tokens_only": "no target",
    "stepline_cap": "cap",
}
# (label, key, lower is better): the head-of-line figures, and which are compared
HOL_FIGURES = [
    ("long request TTFT (s)", "ttft_s", True),
    ("decoders' longest stall (ms)", "itl_inside_max_ms", True),
    ("decoders' ITL p50 inside window (ms)", "itl_inside_p50_ms", True),
    ("decoders' ITL p99 inside window (ms)", "itl_inside_p99_ms", True),
    ("decoders' ITL p50 outside (ms)", "itl_outside_p50_ms", True),
    ("decoders' ITL p99 outside (ms)", "itl_outside_p99_ms", True),
    ("steps (next() calls) in window", "steps_in_window", False),
]
HOL_TARGETS = {"itl_inside_max_ms": 0.33, "ttft_s": 1.0}  # ours / best BatchGenerator <=


def best_batchgen(configs: dict[str, list[dict]]) -> list[dict]:
    """Per repeat, each figure's best (lowest) value over the BatchGenerator configurations."""
    rows = list(configs.values())
    keys = [key for _, key, _ in HOL_FIGURES]
    return [{k: min(r[i][k] for r in rows) for k in keys} for i in range(len(rows[0]))]


def summarize_hol(hol: dict) -> dict:
    bg = hol["batchgen"]
    best = best_batchgen(bg)
    systems = {name: rows for name, rows in hol.items() if name != "batchgen" and rows}
    columns = {**systems, **{f"batchgen_{n}": rows for n, rows in bg.items()}}
    stall_best = min(bg, key=lambda n: _med(bg[n], "itl_inside_max_ms"))
    return {
        "figures": {name: {k: _med(rows, k) for k in rows[0]} for name, rows in columns.items()},
        "best_batchgen_config": {
            key: min(bg, key=lambda n, key=key: _med(bg[n], key)) for _, key, _ in HOL_FIGURES
        },
        "vs_best_batchgen": {
            name: {key: paired(rows, best, key) for _, key, lower in HOL_FIGURES if lower}
            for name, rows in systems.items()
        },
        # The issue's second reading of the TTFT target: against the configuration with the
        # shortest stall (the one the stall target compares with), not the fastest TTFT.
        "ttft_vs_best_stall_config": {
            name: paired(rows, bg[stall_best], "ttft_s") for name, rows in systems.items()
        },
        "foreign_cores": _foreign([r for rows in columns.values() for r in rows]),
    }


def summarize(raw: dict, w: Workload) -> dict:
    summary: dict[str, Any] = {"decode": {}, "profile": raw["profile"]}
    if raw["hol"]["stepline"]:
        summary["hol"] = summarize_hol(raw["hol"])
    decode_rows: list[dict] = []
    for b, d in raw["decode"].items():
        if not d["stepline"]:
            continue  # the decode section did not run
        decode_rows += d["stepline"] + d["bare"] + d["batchgen"]
        summary["decode"][b] = {
            "stepline": _med(d["stepline"], "tokens_per_s"),
            "bare": _med(d["bare"], "tokens_per_s"),
            "batchgen": _med(d["batchgen"], "tokens_per_s"),
            "stepline_vs_bare": paired(d["stepline"], d["bare"], "tokens_per_s"),
            "batchgen_vs_bare": paired(d["batchgen"], d["bare"], "tokens_per_s"),
            "stepline_vs_batchgen": paired(d["stepline"], d["batchgen"], "tokens_per_s"),
            "stepline_step_ms": _med(d["stepline"], "step_ms"),
            "stepline_step_ms_median": _med(d["stepline"], "step_ms_median"),
            "bare_step_ms": _med(d["bare"], "step_ms"),
        }
    summary["decode_foreign_cores"] = _foreign(decode_rows)
    on, off = raw["event_log"]["on"], raw["event_log"]["off"]
    if on and off:
        summary["event_log"] = {
            "off": _med(off, "tokens_per_s"),
            "on": _med(on, "tokens_per_s"),
            "on_vs_off": paired(on, off, "tokens_per_s"),
            "off_step_ms_median": _med(off, "step_ms_median"),
            "off_spread": (
                max(r["tokens_per_s"] for r in off) - min(r["tokens_per_s"] for r in off)
            )
            / _med(off, "tokens_per_s"),
            "on_step_ms_median": _med(on, "step_ms_median"),
            "bytes_written": raw["event_log_bytes"],
            "foreign_cores": _foreign(on + off),
        }
    if raw["blas"][REFERENCE_BLAS]:
        reference = raw["blas"][REFERENCE_BLAS]
        summary["blas"] = {
            name: {
                "prefill_tokens_per_s": _med(rows, "prefill_tokens_per_s"),
                "decode_b1_tokens_per_s": _med(rows, "decode_b1_tokens_per_s"),
                "prefill_vs_reference": paired(rows, reference, "prefill_tokens_per_s"),
                "status": rows[0]["openblas_status"],
            }
            for name, rows in raw["blas"].items()
        }
        summary["blas_foreign_cores"] = _foreign([r for rows in raw["blas"].values() for r in rows])
    if any(raw["host"].values()):
        summary["host"] = {
            b: {
                "host_us_per_token": _med(rows, "host_us_per_token"),
                "runs": [r["host_us_per_token"] for r in rows],
                "loop_us_per_token": _med(rows, "loop_us_per_token"),
                "tokens_per_s": _med(rows, "tokens_per_s"),
            }
            for b, rows in raw["host"].items()
        }
    rows = [r for r in _all_rows(raw) if "attempts" in r]
    summary["measurements"] = len(rows)
    summary["measured_again"] = sum(r["attempts"] > 1 for r in rows)
    summary["still_disturbed"] = sum(r["foreign_cores"] > w.max_foreign_cores for r in rows)
    return summary


def _all_rows(node: Any) -> list[dict]:
    if isinstance(node, dict):
        if "foreign_cores" in node:
            return [node]
        return [r for v in node.values() for r in _all_rows(v)]
    if isinstance(node, list):
        return [r for v in node for r in _all_rows(v)]
    return []


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def _busy(f: dict) -> str:
    return f"other processes kept {f['median']:.2f} cores busy (median; max {f['max']:.2f})"


def print_table(s: dict, w: Workload, env: dict) -> None:
    p = print
    p(f"\nstepline engine benchmark: {env['model']}, {env['cpus']} CPUs, {env['platform']}")
    p(
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, OpenBLAS: {env['openblas']}, "
        f"event loop: {env.get('event_loop', 'asyncio')}"
    )
    p(f"stepline engine config: {env['engine_config']}")
    p(
        f"medians of {w.repeats} repeat(s); a ratio is the median of the per-repeat ratios of "
        "runs made back to back"
    )
    p(
        f"{s['measurements']} measurements; {s['measured_again']} measured again because other "
        f"processes kept > {w.max_foreign_cores} cores busy; {s['still_disturbed']} still "
        f"disturbed after {w.retries} retries"
    )

    if "hol" in s:
        h = s["hol"]
        p(
            f"\n1. Head-of-line: {NUM_DECODERS} requests decode ({w.short_prompt}-token prompts); "
            f"a {w.long_prompt}-token prompt arrives; {_busy(h['foreign_cores'])}"
        )
        p(
            f"   stepline max_step_tokens={w.max_step_tokens}, max_step_ms={w.max_step_ms}"
            + (" ('no target': max_step_ms=None)" if "stepline_tokens_only" in h["figures"] else "")
            + (f" ('cap': long_prefill_cap={w.hol_cap})" if "stepline_cap" in h["figures"] else "")
            + "; BG n: mlx-lm BatchGenerator, prefill_step_size=n"
        )
        names = list(h["figures"])
        label = {**HOL_SYSTEMS, **{f"batchgen_{n}": f"BG {n}" for n in w.bg_hol_steps}}
        ours = [n for n in names if n in h["vs_best_batchgen"]]
        p(
            f"   {'':38}"
            + "".join(f"{label[n]:>10}" for n in names)
            + "".join(f"{label[n] + '/BG':>14}" for n in ours)
            + "  best BG"
        )
        for text, key, lower in HOL_FIGURES:
            line = f"   {text:38}" + "".join(f"{h['figures'][n][key]:10.1f}" for n in names)
            if lower:
                line += "".join(f"{h['vs_best_batchgen'][n][key]:14.2f}" for n in ours)
                line += f"  {label['batchgen_' + h['best_batchgen_config'][key]]}"
            p(line)
        for key, limit in HOL_TARGETS.items():
            ratio = h["vs_best_batchgen"]["stepline"][key]
            p(
                f"   target: stepline {key} <= {limit} x the best BatchGenerator's: {ratio:.2f} "
                f"{verdict(ratio <= limit)}"
            )
        stall_best = h["best_batchgen_config"]["itl_inside_max_ms"]
        p(
            f"   stepline ttft_s vs BG {stall_best} (the configuration with the shortest stall): "
            f"{h['ttft_vs_best_stall_config']['stepline']:.2f}"
        )
        p(
            "   ratio = median over repeats of ours / the best BatchGenerator configuration's "
            "value of that figure in the same repeat"
        )

    if s["decode"]:
        p(
            f"\n2. Decode throughput, tokens/s (greedy, ignore_eos, {w.decode_tokens} steps after "
            f"{w.warm_tokens} warm-up tokens); {_busy(s['decode_foreign_cores'])}"
        )
        p(
            f"   {'batch':>5}{'stepline':>10}{'bare loop':>11}{'ours/bare':>11}{'BatchGen':>10}"
            f"{'BG/bare':>9}{'ours/BG':>9}{'ours ms/step':>14}{'(median)':>10}{'bare ms/step':>14}"
        )
        for b, d in s["decode"].items():
            target = f"  ours/BG >= 1.0 {verdict(d['stepline_vs_batchgen'] >= 1.0)}"
            p(
                f"   {b:>5}{d['stepline']:10.1f}{d['bare']:11.1f}{d['stepline_vs_bare']:11.2f}"
                f"{d['batchgen']:10.1f}{d['batchgen_vs_bare']:9.2f}{d['stepline_vs_batchgen']:9.2f}"
                f"{d['stepline_step_ms']:14.2f}"
                f"{d['stepline_step_ms_median']:10.2f}{d['bare_step_ms']:14.2f}{target}"
            )

    if "event_log" in s:
        e = s["event_log"]
        cost = 1 - e["on_vs_off"]  # > 0: the log slows the engine down
        p(
            f"\n3. Event-log cost, batch {w.event_log_batch} ({EVENT_LOG_PAIRS} on/off pairs per "
            f"repeat, fresh engines); {_busy(e['foreign_cores'])}"
        )
        p(
            f"   off {e['off']:.1f} tok/s, on {e['on']:.1f} tok/s: on/off {e['on_vs_off']:.3f}, "
            f"{'the log costs' if cost >= 0 else 'the logged engine was faster by'} "
            f"{100 * abs(cost):.1f}% (target <= 3% {verdict(cost <= 0.03)}); "
            f"run-to-run spread of 'off' alone {100 * e['off_spread']:.1f}%"
        )
        p(
            f"   median step {e['off_step_ms_median']:.2f} ms off, "
            f"{e['on_step_ms_median']:.2f} ms on; {e['bytes_written'] / 1e3:.0f} kB of log written"
        )

    if "blas" in s:
        p(
            f"\n4. BLAS: one {w.blas_prompt}-token prompt's prefill, a fresh process per variant; "
            f"{_busy(s['blas_foreign_cores'])}"
        )
        p(f"   {'variant':42}{'prefill tok/s':>14}{'vs reference':>14}{'decode b1 tok/s':>17}")
        for name, r in s["blas"].items():
            p(
                f"   {name:42}{r['prefill_tokens_per_s']:14.1f}{r['prefill_vs_reference']:13.1f}x"
                f"{r['decode_b1_tokens_per_s']:17.1f}"
            )

    if "host" in s:
        p(
            f"\n5. The engine's own Python (a runner that returns every token at once; event log "
            f"on; {HOST_TOKENS} tokens a request; medians of {w.repeats}):"
        )
        p(f"   {'batch':>8}{'host us/token':>16}{'of it, loop':>14}{'tokens/s':>12}   runs")
        for b, r in s["host"].items():
            runs = ", ".join(f"{x:.1f}" for x in r["runs"])
            p(
                f"   {b:>8}{r['host_us_per_token']:16.1f}{r['loop_us_per_token']:14.1f}"
                f"{r['tokens_per_s']:12.0f}   {runs}"
            )

    if s["profile"]:
        p(
            f"\n6. Where a stepline decode step goes (instrumented runs; ms per step, medians "
            f"of {w.repeats} runs' medians)."
        )
        p("   executor thread: run = forward (evaluated on the spot) + sampler + other;")
        p("   asyncio thread: hop = executor call minus run; commit = events, request actors,")
        p("   clients; loop = the rest (schedule, step record, metrics). bare = bare loop step.")
        cols = [
            ("batch", "batch", "d"),
            ("log", "event_log", "s"),
            ("wall", "step_wall_ms", ".2f"),
            ("run", "runner_run_ms", ".2f"),
            ("forward", "forward_ms", ".2f"),
            ("sampler", "sampler_ms", ".2f"),
            ("run other", "runner_other_ms", ".2f"),
            ("hop", "executor_hop_ms", ".2f"),
            ("commit", "commit_ms", ".2f"),
            ("loop", "loop_other_ms", ".2f"),
            ("bare", "bare_step_ms", ".2f"),
        ]
        p("   " + "".join(f"{name:>10}" for name, _, _ in cols))
        for r in s["profile"]:
            p("   " + "".join(f"{r[key]:>10{fmt}}" for _, key, fmt in cols))
        p("   CPU ms per step by thread (native = MLX's stream thread + OpenBLAS's workers):")
        for r in s["profile"]:
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_ms_per_step"].items()))
            p(f"   batch {r['batch']}, event log {r['event_log']}: {cpu}")
        p("   host CPU per generated token (asyncio + event-log threads' CPU / batch):")
        for r in s["profile"]:
            target = "; target <= 35 us" if r["batch"] == 32 and r["event_log"] == "on" else ""
            us = r["host_us_per_token"]
            runs = ", ".join(f"{x:.1f}" for x in r["host_us_per_token_runs"])
            p(
                f"   batch {r['batch']}, event log {r['event_log']}: {us:.1f} us "
                f"(median of {runs}){target}"
            )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="what `stepline serve --model` takes (e.g. SmolLM2-135M-Instruct, the real "
        "default model; a demo name; a GGUF file, directory or HF id)",
    )
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run")
    ap.add_argument("--repeats", type=int, help="repeats per measurement (default 3; quick 1)")
    ap.add_argument("--long-prompt", type=int, help="head-of-line prompt tokens (default 4000)")
    ap.add_argument("--max-step-tokens", type=int, help="stepline's budget (default 512)")
    ap.add_argument(
        "--max-step-ms",
        type=float,
        help="stepline's step-time target (default 100; 0: none, and no 'no target' run)",
    )
    ap.add_argument(
        "--sections",
        default="hol,decode,event_log,host,blas",
        help="comma-separated: hol, decode, event_log, host, blas (default: all)",
    )
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        help="stepline's event loop (default: uvloop where installed, as `stepline serve` runs)",
    )
    ap.add_argument(
        "--max-foreign-cores",
        type=float,
        help="measure again while other processes keep more cores busy (default 0.25)",
    )
    ap.add_argument("--retries", type=int, help="most times to measure again (default 2)")
    ap.add_argument("--blas-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blas-prompt", type=int, help="OpenBLAS prompt tokens (default 512)")
    args = ap.parse_args(argv)

    w = QUICK if args.quick else Workload()
    overrides = {
        "repeats": args.repeats,
        "long_prompt": args.long_prompt,
        "max_step_tokens": args.max_step_tokens,
        "max_step_ms": args.max_step_ms,
        "blas_prompt": args.blas_prompt,
        "max_foreign_cores": args.max_foreign_cores,
        "retries": args.retries,
    }
    w = replace(w, **{k: v for k, v in overrides.items() if v is not None})
    if args.max_step_ms == 0:
        w = replace(w, max_step_ms=None)
    w = replace(
        w, sections=tuple(args.sections.split(",")), profile=w.profile and "decode" in args.sections
    )

    if args.blas_worker:
        print(json.dumps(blas_worker(args.model, w.blas_prompt, decode_tokens=16)))
        return

    env = {
        "model": args.model,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": importlib.metadata.version("mlx"),
        "mlx_lm": importlib.metadata.version("mlx-lm"),
        "openblas": _blas.status()[1],
        "event_loop": args.loop,
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "load_start": loadavg(),
    }
    t0 = time.perf_counter()
    if args.loop == "asyncio":
        raw = asyncio.run(run_all(args.model, w))
    else:  # what `stepline serve` runs on (uvloop where installed)
        raw = engine_run(run_all, args.model, w)
    env["load_end"] = loadavg()
    env["seconds"] = time.perf_counter() - t0
    env["engine_config"] = raw.pop("engine_config", {})
    summary = summarize(raw, w)
    print_table(summary, w, env)
    print(f"\n({env['seconds']:.0f} s; command: {env['command']})")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"env": env, "workload": asdict(w), "summary": summary, "raw": raw},
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
