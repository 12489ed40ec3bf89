"""Export a run to the Chrome Trace Event format (JSON), which ui.perfetto.dev and
chrome://tracing open, with zoom and search.

Tracks (one process each; timestamps are microseconds from the run's first event):
- **engine**: thread "steps" holds one complete slice ("X") per step, as long as the executor
  took, with its tokens, decode rows, prefill chunks and predicted time in its arguments;
  a counter track "step time (ms)" plots measured against predicted.
- **requests**: one thread per request, named by its full id, in admission order, holding
  "queued" (admission to its first step), one "prefill [a, b)" slice per chunk step,
  "decode" slices over consecutive decode steps, an instant at its first token and at its
  end, and a "stall …" slice over each wait between two tokens above the stall threshold.
  A flow arrow runs from the step that caused the stall (the slowest step in the wait) to
  that slice.

Slices on one thread never overlap (a step's slice is cut where the next step was planned),
so trace viewers nest them as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepline.events.replay.timeline import RequestLife, RunTimeline, StepSpan, collect, format_ms

ENGINE_PID, REQUESTS_PID, STEPS_TID = 1, 2, 1


@dataclass(frozen=True)
class TraceStats:
    """What the export wrote."""

    num_events: int  # trace events in the file
    num_steps: int
    num_requests: int
    num_stalls: int
    stall_threshold_s: float


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def trace_events(timeline: RunTimeline) -> Iterator[dict[str, Any]]:
    """The trace events of `timeline`, one at a time: metadata, then steps, then requests."""
    ends = _step_ends(timeline)
    yield _meta("process_name", ENGINE_PID, None, f"engine ({Path(timeline.path).name})")
    yield _meta("process_sort_index", ENGINE_PID, None, 0)
    yield _meta("thread_name", ENGINE_PID, STEPS_TID, "steps")
    yield _meta("process_name", REQUESTS_PID, None, "requests")
    yield _meta("process_sort_index", REQUESTS_PID, None, 1)
    causes = timeline.causing_steps()
    for span in timeline.steps.values():
        yield from _step(span, ends[span.step], causes.get(span.step, []))
    flow_id = 0
    for life in timeline.requests.values():
        tid = life.order + 1
        yield _meta("thread_name", REQUESTS_PID, tid, life.request_id)
        yield _meta("thread_sort_index", REQUESTS_PID, tid, life.order)
        for event in _request(life, timeline, ends):
            yield event
            if event.get("cat") == "stall" and event["args"].get("cause_step") is not None:
                flow_id += 1
                yield from _flow(flow_id, timeline.steps[event["args"]["cause_step"]], ends, event)


def _meta(name: str, pid: int, tid: int | None, value: str | int) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _step_ends(timeline: RunTimeline) -> dict[int, float]:
    """Each step's end, cut where the next step was planned (a measurement that runs past it
    would make two slices of one track overlap)."""
    ends: dict[int, float] = {}
    spans = list(timeline.steps.values())
    for span, following in zip(spans, [*spans[1:], None], strict=False):
        end = span.end if following is None else min(span.end, following.start)
        ends[span.step] = max(end, span.start)
    return ends


def _step(span: StepSpan, end: float, caused: list) -> list[dict[str, Any]]:
    args: dict[str, Any] = {
        "measured_ms": round(span.seconds * 1000, 3),
        "predicted_ms": None if span.predicted is None else round(span.predicted * 1000, 3),
        "estimated": span.estimated,
        "tokens": span.num_tokens,
        "max_step_tokens": span.max_step_tokens,
        "decode_rows": span.num_decode_rows,
        "chunk_tokens": span.num_chunk_tokens,
        "image_encoders": len(span.encodes),
        "contents": span.contents(),
    }
    if caused:
        args["stalled"] = [f"{m.request_id} {format_ms(m.seconds)}" for m in caused]
    events: list[dict[str, Any]] = [
        {
            "ph": "X",
            "name": f"step {span.step}",
            "cat": "step,stall" if caused else "step",
            "pid": ENGINE_PID,
            "tid": STEPS_TID,
            "ts": _us(span.start),
            "dur": _us(end - span.start),
            "args": args,
        }
    ]
    counter = {"measured": round(span.seconds * 1000, 3)}
    if span.predicted is not None:
        counter["predicted"] = round(span.predicted * 1000, 3)
    events.append(
        {"ph": "C", "name": "step time (ms)", "pid": ENGINE_PID, "ts": _us(span.start),
         "args": counter}
    )  # fmt: skip
    return events


def _slice(life: RequestLife, name: str, cat: str, start: float, end: float, **args: Any):
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": REQUESTS_PID,
        "tid": life.order + 1,
        "ts": _us(start),
        "dur": _us(max(0.0, end - start)),
        "args": args,
    }


def _instant(life: RequestLife, name: str, at: float, **args: Any) -> dict[str, Any]:
    return {
        "ph": "i",
        "s": "t",
        "name": name,
        "cat": "request",
        "pid": REQUESTS_PID,
        "tid": life.order + 1,
        "ts": _us(at),
        "args": args,
    }


def _request(life: RequestLife, timeline: RunTimeline, ends: dict[int, float]):
    steps = timeline.steps

    def start_of(step: int) -> float:
        return steps[step].start if step in steps else life.admitted_at

    def end_of(step: int) -> float:
        return ends.get(step, start_of(step))

    if life.first_scheduled_at is not None and life.first_scheduled_at > life.admitted_at:
        yield _slice(life, "queued", "queued", life.admitted_at, life.first_scheduled_at)
    for step, (a, b) in life.chunks.items():
        yield _slice(
            life,
            f"prefill [{a}, {b})",
            "prefill",
            start_of(step),
            end_of(step),
            step=step,
            num_prompt_tokens=life.num_prompt_tokens,
            num_cached_tokens=life.num_cached_tokens,
        )
    stalls = {m.to_step: m for m in life.stalls}
    run: tuple[int, int, int] | None = None  # consecutive decode steps: first, last, tokens
    for step, n in zip(life.token_steps, life.token_counts, strict=True):
        if step in life.chunks:
            continue  # the first token, with the last chunk
        mark = stalls.get(step)
        if run is not None and (mark is not None or step != run[1] + 1):
            yield _decode(life, run, start_of, end_of)
            run = None
        if mark is None:
            run = (step, step, n) if run is None else (run[0], step, run[2] + n)
            continue
        begin = next((s for s in range(mark.from_step + 1, step + 1) if s in steps), step)
        yield _slice(
            life,
            f"stall {format_ms(mark.seconds)}",
            "stall",
            start_of(begin),
            end_of(step),
            gap_ms=round(mark.seconds * 1000, 3),
            from_step=mark.from_step,
            to_step=mark.to_step,
            cause_step=mark.cause_step,
            cause=mark.cause,
        )
    if run is not None:
        yield _decode(life, run, start_of, end_of)
    if life.token_steps:
        first = life.token_steps[0]
        yield _instant(
            life,
            "first token",
            end_of(first),
            step=first,
            ttft_ms=None if life.ttft is None else round(life.ttft * 1000, 3),
        )
    if life.terminal is not None and life.terminal_at is not None:
        yield _instant(
            life,
            life.terminal.reason.value,
            life.terminal_at,
            step=life.terminal.step,
            message=life.terminal.message,
            e2e_ms=None if life.e2e is None else round(life.e2e * 1000, 3),
        )


def _decode(life: RequestLife, run: tuple[int, int, int], start_of, end_of) -> dict[str, Any]:
    a, b, n = run
    return _slice(life, "decode", "decode", start_of(a), end_of(b), steps=f"{a}..{b}", tokens=n)


def _flow(flow_id: int, cause: StepSpan, ends: dict[int, float], stall: dict[str, Any]):
    """An arrow from the middle of the causing step's slice to the middle of the stall's."""
    middle = _us((cause.start + ends[cause.step]) / 2)
    common = {"name": "stalled by", "cat": "stall", "id": flow_id}
    return [
        {**common, "ph": "s", "pid": ENGINE_PID, "tid": STEPS_TID, "ts": middle},
        {
            **common,
            "ph": "f",
            "bp": "e",
            "pid": REQUESTS_PID,
            "tid": stall["tid"],
            "ts": round(stall["ts"] + stall["dur"] / 2, 3),
        },
    ]


def export_trace(
    path: str | Path,
    target: str | Path,
    *,
    run: int | None = None,
    model: str | None = None,
    stall_s: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> TraceStats:
    """Write one run of the log at `path` (one model of a log several share) to `target` as
    Trace Event JSON.

    `run` picks one run of a log of several (1-based), `model` one model; `stall_s` is the
    stall threshold in seconds (default: three times the run's median gap between tokens).
    Raises what `collect` raises, and OSError if `target` cannot be written.
    """
    timeline = collect(path, run=run, model=model, stall_s=stall_s, progress=progress)
    other = {
        "source": "stepline replay --trace",
        "log": str(path),
        "run": run,
        "model": timeline.model,
        "stall_threshold_ms": round(timeline.stall_threshold * 1000, 3),
    }
    compact = json.JSONEncoder(separators=(",", ":")).encode
    num_events = 0
    with open(target, "w", encoding="utf-8") as f:  # written as made: a big log's trace is big
        f.write('{"displayTimeUnit":"ms","otherData":' + compact(other) + ',"traceEvents":[\n')
        for event in trace_events(timeline):
            f.write((",\n" if num_events else "") + compact(event))
            num_events += 1
        f.write("\n]}\n")
    return TraceStats(
        num_events=num_events,
        num_steps=len(timeline.steps),
        num_requests=len(timeline.requests),
        num_stalls=len(timeline.stalls),
        stall_threshold_s=timeline.stall_threshold,
    )
