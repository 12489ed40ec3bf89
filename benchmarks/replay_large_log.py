"""Benchmark: `stepline replay` on a large event log (default 1,000,000 events).

Writes a log of a simulated busy engine (continuous batching, chunked prefill under a token
budget, checkpoints, a few cancellations; each step's plan with what sized its chunks and who
sat it out, and its measured time against a step-time target) with the real EventLogWriter,
then times `stepline replay LOG` (the summary) and `stepline replay LOG --verify` in fresh processes
and reports their peak resident memory, next to a process that only imports the command.
Also reports the Python-heap peak of `summarize()` measured with tracemalloc, and the size
and time of the picture (`--svg`, slowest 25 requests drawn, the rest folded) and of the
Chrome trace (`--trace`) of the same log.

    .venv/bin/python benchmarks/replay_large_log.py [--events N] [--max-output N] [--dir DIR]
        [--keep]

`--max-output 40` makes short requests: about 10,000 of them in 350,000 events.

No model, no MLX: it measures the log and replay only.
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stepline.events.log import EventLogWriter, log_files
from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    FinishReason,
    LogHeader,
    RequestParams,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)
from stepline.events.replay import summarize
from stepline.events.replay.svg import render_svg
from stepline.events.replay.trace import export_trace

PARAMS = RequestParams(max_tokens=512, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)


@dataclass
class _Req:
    rid: str
    num_prompt: int
    num_output: int  # tokens it will generate
    checkpoint: int
    computed: int = 0
    generated: int = 0


def simulate(
    num_events: int,
    *,
    max_step_tokens: int = 512,
    max_num_seqs: int = 64,
    long_prefill_cap: int = 256,
    max_output: int = 400,
    seed: int = 0,
) -> Iterator:
    """Events of a simulated engine under steady load, about `num_events` of them."""
    rng = random.Random(seed)
    seq = 0
    step = 0
    ts = 1_700_000_000.0
    waiting: list[_Req] = []
    running: list[_Req] = []
    n = 0

    def ev(cls, **fields):
        nonlocal seq
        seq += 1
        return cls(seq=seq, ts=ts, step=step, **fields)

    while seq < num_events:
        while len(waiting) < 8:  # arrivals keep a queue
            n += 1
            num_prompt = rng.randint(30, 3000)
            num_output = rng.randint(min(10, max_output), max_output)
            req = _Req(f"req-{n}", num_prompt, num_output, rng.randint(1, num_prompt))
            waiting.append(req)
            yield ev(
                Admitted,
                request_id=req.rid,
                num_prompt_tokens=num_prompt,
                prompt_token_ids=None,
                prompt_sha256="0" * 64,
                checkpoints=(req.checkpoint,),
                params=PARAMS,
            )
        step += 1
        budget = max_step_tokens
        entries: list[tuple[_Req, str, int]] = []
        for r in running:
            if r.computed == r.num_prompt and budget > 0:
                entries.append((r, "decode", 1))
                budget -= 1
        limits: list[str | None] = [None] * len(entries)

        def chunk(r: _Req, entries=entries, limits=limits) -> None:
            nonlocal budget
            left = r.num_prompt - r.computed
            k = min(left, budget, long_prefill_cap)
            limits.append(
                "prompt-end" if k == left else "budget" if k == budget else "long-prefill-cap"
            )
            entries.append((r, "prefill", k))
            budget -= k

        for r in running:
            if r.computed < r.num_prompt and budget > 0:
                chunk(r)
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            chunk(r)
        held = waiting[:8]
        ts += 0.002
        yield ev(
            StepPlanned,
            request_ids=tuple(r.rid for r, _, _ in entries),
            num_tokens=tuple(k for _, _, k in entries),
            kinds=tuple(kind for _, kind, _ in entries),
            max_step_tokens=max_step_tokens,
            max_num_seqs=max_num_seqs,
            limits=tuple(limits),
            held_ids=tuple(r.rid for r in held),
            held_reasons=("budget" if budget == 0 else "max-num-seqs",) * len(held),
        )
        predicted = 0.004 + (max_step_tokens - budget) * 2e-5  # the forward pass
        seconds = predicted * rng.uniform(0.8, 1.3)
        ts += seconds
        yield ev(
            StepFinished,
            seconds=seconds,
            predicted_seconds=predicted,
            cpu_share=rng.uniform(1.5, 2.0),
            load_avg=2.0,
        )
        sampled = []
        for r, kind, k in entries:
            if kind == "prefill":
                start, end = r.computed, r.computed + k
                if start < r.checkpoint < end:
                    yield ev(ChunkPrefilled, request_id=r.rid, start=start, end=r.checkpoint)
                    yield ev(CheckpointReached, request_id=r.rid, offset=r.checkpoint)
                    yield ev(ChunkPrefilled, request_id=r.rid, start=r.checkpoint, end=end)
                else:
                    yield ev(ChunkPrefilled, request_id=r.rid, start=start, end=end)
                    if end == r.checkpoint:
                        yield ev(CheckpointReached, request_id=r.rid, offset=end)
                r.computed = end
                if end < r.num_prompt:
                    continue
            sampled.append(r)
        if sampled:  # the step's tokens, one event (as the engine records them)
            yield ev(
                TokensSampled,
                request_ids=tuple(r.rid for r in sampled),
                token_ids=tuple(rng.randrange(32_000) for _ in sampled),
            )
        for r in sampled:
            r.generated += 1
            if r.generated >= r.num_output:
                yield ev(Terminal, request_id=r.rid, reason=FinishReason.LENGTH)
                running.remove(r)
            elif rng.random() < 0.0005:
                yield ev(Terminal, request_id=r.rid, reason=FinishReason.CANCELLED, message="gone")
                running.remove(r)


# Runs the command in a fresh interpreter and prints its own peak RSS (VmHWM) on stderr.
# ru_maxrss of a child is no good here: on Linux it carries over the parent's high-water
# mark from before exec.
_WRAPPER = """
import sys
import stepline.api.cli.replay
from stepline.api.cli import main
code = main(sys.argv[1:]) if sys.argv[1:] else 0
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print("VMHWM", int(hwm.split()[1]), file=sys.stderr)
sys.exit(code)
"""


def _child(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of `stepline ARGV` in a fresh process."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    kib = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("VMHWM")]
    return wall, (kib[0] / 1024 if kib else float("nan")), proc.returncode


def _write(
    path: Path, header: LogHeader, num_events: int, rotate_bytes: int | None, max_output: int
) -> None:
    started = time.perf_counter()
    appending = 0.0
    with EventLogWriter(path, header, rotate_bytes=rotate_bytes, overwrite=True) as writer:
        for event in simulate(num_events, max_output=max_output):
            t = time.perf_counter()
            writer.append(event)
            appending += time.perf_counter() - t
    print(
        f"wrote {num_events:,} events in {time.perf_counter() - started:.1f} s (simulation "
        f"included); inside append(): {appending / num_events * 1e6:.2f} us/event"
    )


def _pictures(path: Path, workdir: Path) -> None:
    """Size and time of the picture and the trace of the log."""
    started = time.perf_counter()
    svg = render_svg(path)
    svg_s = time.perf_counter() - started
    (workdir / "run.svg").write_text(svg, encoding="utf-8")
    rows = svg.count('class="request"')
    print(
        f"picture (--svg): {len(svg.encode()) / 1024:.0f} KiB in {svg_s:.1f} s "
        f"({rows} request rows drawn)"
    )
    started = time.perf_counter()
    stats = export_trace(path, workdir / "run.trace.json")
    trace_s = time.perf_counter() - started
    size = (workdir / "run.trace.json").stat().st_size
    print(
        f"trace (--trace): {size / 2**20:.1f} MiB, {stats.num_events:,} trace events in "
        f"{trace_s:.1f} s ({stats.num_requests:,} requests, {stats.num_steps:,} steps, "
        f"{stats.num_stalls:,} stalls over {stats.stall_threshold_s * 1000:.1f} ms)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--max-output", type=int, default=400, help="most tokens a request makes")
    p.add_argument("--dir", type=Path, default=None, help="where to write the log (default: tmp)")
    p.add_argument("--keep", action="store_true", help="keep the log afterwards")
    p.add_argument("--rotate-bytes", type=int, default=None)
    p.add_argument("--reuse", action="store_true", help="time an existing --dir log again")
    p.add_argument("--write-only", action="store_true", help="write the log, time nothing")
    p.add_argument("--no-pictures", action="store_true", help="skip --svg and --trace")
    args = p.parse_args()

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="stepline-replay-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "run.jsonl"
    config = {
        "max_step_tokens": 512,
        "max_num_seqs": 64,
        "long_prefill_cap": 256,
        "max_step_ms": 14.0,
    }
    header = LogHeader(created=time.time(), model="simulated", config=config, log_prompts=False)
    try:
        if args.reuse and path.exists():
            print(f"reusing {path}")
        else:
            _write(path, header, args.events, args.rotate_bytes, args.max_output)
        size = sum(f.stat().st_size for f in log_files(path))
        print(f"log: {size / 2**20:.1f} MiB in {len(log_files(path))} file(s)")
        if args.write_only:
            return 0

        base_s, base_mib, _ = _child([])
        print(f"baseline process (imports the command only): {base_s:.2f} s, {base_mib:.0f} MiB")
        for label, extra in (("summary", []), ("verify", ["--verify"])):
            wall, mib, code = _child(["replay", str(path), *extra])
            print(f"stepline replay {label}: {wall:.2f} s, peak RSS {mib:.0f} MiB (exit {code})")

        tracemalloc.start()
        started = time.perf_counter()
        summary = summarize(path)
        traced_s = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(
            f"summarize() under tracemalloc: {traced_s:.1f} s, Python heap peak "
            f"{peak / 2**20:.1f} MiB ({summary.num_requests:,} requests, "
            f"{summary.num_steps:,} steps, {summary.num_output_tokens:,} output tokens)"
        )
        if not args.no_pictures:
            _pictures(path, workdir)
        own_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"this process peak RSS: {own_mib:.0f} MiB")
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.keep:
            print(f"kept {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
