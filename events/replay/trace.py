"""Export a run to the Chrome Trace Event format (JSON), which ui.perfetto.dev and
chrome://tracing open, with zoom and search.

**Time** is whole microseconds (the format's unit) from the run's first event. Every
boundary (a step's start and end, a request's admission and end) is rounded to a
microsecond once, and a slice's `ts` and `dur` are integers taken from those boundaries, so
a slice that ends where the next begins ends exactly at the next one's `ts`: no reader
(Perfetto multiplies a fractional `ts` by 1000 in floating point) sees them overlap.

Tracks (one process each):
- **engine**: thread "steps" holds one complete slice ("X") per step, as long as the executor
  took, with its tokens, decode rows, prefill chunks and predicted time in its arguments;
  a counter track "step time (ms)" plots measured against predicted.
- **requests**: at most `tracks` threads ("requests #1", ...), packed like intervals: each
  request is one slice named by its full id, from its admission to its end, on the
  lowest-numbered track free at its admission. Nested in it: "queued" (admission to its
  first step), one "prefill [a, b)" slice per chunk step, "decode" slices over consecutive
  decode steps, an instant at its first token and at its end, and a "stall …" slice over
  each wait between two tokens above the stall threshold. A flow arrow runs from the step
  that caused the stall (the slowest step in the wait) to that slice. Every slice's
  arguments carry its `request_id`.

  Where more requests are in flight at once than there are tracks, the requests that
  waited longest for a token are drawn and the rest are counted, not drawn (the process's
  name and `otherData` say how many); `--request ID` exports one request alone.

Slices on one track never overlap partly (a step's slice is cut where the next step was
planned, a request's phases are cut to its life), so trace viewers nest them as they are;
`check_trace` checks that, and is what the tests run on every trace they write.
"""

from __future__ import annotations

import bisect
import heapq
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepline.events.replay.timeline import RequestLife, RunTimeline, StepSpan, collect, format_ms

ENGINE_PID, REQUESTS_PID, STEPS_TID = 1, 2, 1
DEFAULT_TRACKS = 128  # request tracks: max_num_seqs (32 by default) running, and those queued

# The phases `check_trace` knows: complete, begin/end, instant (old and new letter),
# counter, flow start/step/end, metadata.
KNOWN_PHASES = frozenset({"X", "B", "E", "i", "I", "C", "s", "t", "f", "M"})
_MAX_PROBLEMS = 100


@dataclass(frozen=True)
class TraceStats:
    """What the export wrote."""

    num_events: int  # trace events in the file
    num_steps: int
    num_requests: int
    num_stalls: int
    stall_threshold_s: float
    num_tracks: int = 0  # request tracks used
    num_requests_drawn: int = 0  # the rest were in flight while every track was taken

    @property
    def num_requests_not_drawn(self) -> int:
        return self.num_requests - self.num_requests_drawn


def _us(seconds: float) -> int:
    """A boundary, in whole microseconds."""
    return round(seconds * 1e6)


Bounds = dict[int, tuple[int, int]]  # step -> [start, end) in microseconds


@dataclass(frozen=True)
class Packing:
    """Which track (1-based) each request is drawn on, by admission order; None: not drawn."""

    track_of: list[int | None]
    num_tracks: int

    @property
    def num_drawn(self) -> int:
        return sum(t is not None for t in self.track_of)


def trace_events(
    timeline: RunTimeline, *, tracks: int = DEFAULT_TRACKS, packing: Packing | None = None
) -> Iterator[dict[str, Any]]:
    """The trace events of `timeline`, one at a time: metadata, then steps, then requests
    (on at most `tracks` tracks; `packing` if already made by `pack_requests`)."""
    bounds = step_bounds(timeline)
    lives = list(timeline.requests.values())
    if packing is None:
        packing = pack_requests(timeline, bounds, tracks)
    yield _meta("process_name", ENGINE_PID, None, f"engine ({Path(timeline.path).name})")
    yield _meta("process_sort_index", ENGINE_PID, None, 0)
    yield _meta("thread_name", ENGINE_PID, STEPS_TID, "steps")
    not_drawn = len(lives) - packing.num_drawn
    name = "requests" + (
        f" ({not_drawn} of {len(lives)} not drawn: in flight while all "
        f"{packing.num_tracks} tracks were taken)"
        if not_drawn
        else ""
    )
    yield _meta("process_name", REQUESTS_PID, None, name)
    yield _meta("process_sort_index", REQUESTS_PID, None, 1)
    for tid in range(1, packing.num_tracks + 1):
        yield _meta("thread_name", REQUESTS_PID, tid, f"requests #{tid}")
        yield _meta("thread_sort_index", REQUESTS_PID, tid, tid)
    causes = timeline.causing_steps()
    for span in timeline.steps.values():
        yield from _step(span, bounds[span.step], causes.get(span.step, []))
    flow_id = 0
    for life, track in zip(lives, packing.track_of, strict=True):
        if track is None:
            continue
        for event in _request(life, track, timeline, bounds):
            yield event
            if event.get("cat") == "stall" and event["args"].get("cause_step") is not None:
                flow_id += 1
                cause = event["args"]["cause_step"]
                yield from _flow(flow_id, bounds[cause], event)


def _meta(name: str, pid: int, tid: int | None, value: str | int) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def step_bounds(timeline: RunTimeline) -> Bounds:
    """Each step's [start, end) in microseconds, its end cut where the next step was planned
    (a measurement that runs past it would make two slices of one track overlap)."""
    bounds: Bounds = {}
    spans = list(timeline.steps.values())
    for span, following in zip(spans, [*spans[1:], None], strict=False):
        start, end = _us(span.start), _us(span.end)
        if following is not None:
            end = min(end, _us(following.start))
        bounds[span.step] = (start, max(end, start))
    return bounds


def _step(span: StepSpan, bound: tuple[int, int], caused: list) -> list[dict[str, Any]]:
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
    start, end = bound
    events: list[dict[str, Any]] = [
        {
            "ph": "X",
            "name": f"step {span.step}",
            "cat": "step,stall" if caused else "step",
            "pid": ENGINE_PID,
            "tid": STEPS_TID,
            "ts": start,
            "dur": end - start,
            "args": args,
        }
    ]
    counter = {"measured": round(span.seconds * 1000, 3)}
    if span.predicted is not None:
        counter["predicted"] = round(span.predicted * 1000, 3)
    events.append(
        {"ph": "C", "name": "step time (ms)", "pid": ENGINE_PID, "ts": start, "args": counter}
    )
    return events


# -- requests on tracks ----------------------------------------------------------------------


def life_bounds(life: RequestLife, bounds: Bounds) -> tuple[int, int]:
    """A request's life in microseconds: from its admission to the end of its last step or
    its terminal event, whichever is later."""
    start = _us(life.admitted_at)
    ends = [start]
    ends += (bounds[s][1] for s in life.chunks if s in bounds)
    if life.token_steps and life.token_steps[-1] in bounds:
        ends.append(bounds[life.token_steps[-1]][1])
    if life.terminal_at is not None:
        ends.append(_us(life.terminal_at))
    return start, max(ends)


def pack_requests(timeline: RunTimeline, bounds: Bounds, tracks: int) -> Packing:
    """Each request's track: by admission, the lowest-numbered track free at its admission.

    A track holds one request at a time; a request of no duration still takes its track for
    a microsecond. Where more than `tracks` requests are in flight at once, the requests that
    waited longest for a token are kept (each where it leaves at most `tracks` in flight at
    every moment), and the rest get None. Raises ValueError if `tracks` is under 1.
    """
    if tracks < 1:
        raise ValueError(f"a trace needs at least one request track, not {tracks}")
    lives = list(timeline.requests.values())
    spans = []
    for life in lives:
        start, end = life_bounds(life, bounds)
        spans.append((start, max(end, start + 1)))  # half-open, at least a microsecond
    keep = _keep(spans, [life.longest_wait for life in lives], tracks)
    out: list[int | None] = [None] * len(lives)
    busy: list[tuple[int, int]] = []  # (end, track) of the tracks in use
    free: list[int] = []  # tracks released, lowest first
    opened = 0
    for i in sorted(keep, key=lambda i: (spans[i][0], i)):
        start, end = spans[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            tid = heapq.heappop(free)
        else:  # never past `tracks`: greedy by start uses as many tracks as the most in flight
            opened += 1
            tid = opened
        heapq.heappush(busy, (end, tid))
        out[i] = tid
    return Packing(track_of=out, num_tracks=opened)


def _keep(spans: list[tuple[int, int]], waits: list[float], tracks: int) -> list[int]:
    """The requests to draw: all if no more than `tracks` are ever in flight at once; else,
    longest wait first, each that keeps every moment at most `tracks` in flight."""
    changes = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    in_flight = most = 0
    for _, delta in changes:  # at one time, ends (-1) sort before starts: half-open spans
        in_flight += delta
        most = max(most, in_flight)
    if most <= tracks:
        return list(range(len(spans)))
    import numpy as np  # only for a run with more requests in flight than tracks

    times = np.unique(np.array(spans, dtype=np.int64).ravel())
    cover = np.zeros(len(times), dtype=np.int32)  # requests kept in flight in [times[k], ..)
    kept = []
    for i in sorted(range(len(spans)), key=lambda i: (-waits[i], i)):
        a, b = np.searchsorted(times, spans[i])
        if cover[a:b].max() < tracks:
            cover[a:b] += 1
            kept.append(i)
    return kept


def _clamp(event: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """`event` within [start, end]: a request's phases nest in its life whatever the log."""
    ts = min(max(event["ts"], start), end)
    if "dur" in event:
        event["dur"] = max(0, min(event["ts"] + event["dur"], end) - ts)
    event["ts"] = ts
    return event


def _request(life: RequestLife, tid: int, timeline: RunTimeline, bounds: Bounds):
    """The request's life slice, then its phases nested in it."""
    start, end = life_bounds(life, bounds)
    rid = life.request_id
    yield {
        "ph": "X",
        "name": rid,
        "cat": "request",
        "pid": REQUESTS_PID,
        "tid": tid,
        "ts": start,
        "dur": end - start,
        "args": {
            "request_id": rid,
            "prompt_tokens": life.num_prompt_tokens,
            "cached_tokens": life.num_cached_tokens,
            "output_tokens": life.num_output_tokens,
            "ttft_ms": _ms(life.ttft),
            "queued_ms": _ms(life.queued),
            "e2e_ms": _ms(life.e2e),
            "end": None if life.terminal is None else life.terminal.reason.value,
        },
    }
    for event in _phases(life, tid, timeline, bounds):
        yield _clamp(event, start, end)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _phases(life: RequestLife, tid: int, timeline: RunTimeline, bounds: Bounds):
    admitted = _us(life.admitted_at)
    rid = life.request_id

    def start_of(step: int) -> int:
        return bounds[step][0] if step in bounds else admitted

    def end_of(step: int) -> int:
        return bounds[step][1] if step in bounds else admitted

    def piece(name: str, cat: str, a: int, b: int, **args: Any) -> dict[str, Any]:
        return {
            "ph": "X",
            "name": name,
            "cat": cat,
            "pid": REQUESTS_PID,
            "tid": tid,
            "ts": a,
            "dur": max(0, b - a),
            "args": {"request_id": rid, **args},
        }

    def instant(name: str, at: int, **args: Any) -> dict[str, Any]:
        return {
            "ph": "i",
            "s": "t",
            "name": name,
            "cat": "request",
            "pid": REQUESTS_PID,
            "tid": tid,
            "ts": at,
            "args": {"request_id": rid, **args},
        }

    if life.first_scheduled_at is not None and life.first_scheduled_at > life.admitted_at:
        yield piece("queued", "queued", admitted, _us(life.first_scheduled_at))
    for step, (a, b) in life.chunks.items():
        yield piece(
            f"prefill [{a}, {b})",
            "prefill",
            start_of(step),
            end_of(step),
            step=step,
            num_prompt_tokens=life.num_prompt_tokens,
            num_cached_tokens=life.num_cached_tokens,
        )
    stalls = {m.to_step: m for m in life.stalls}
    steps = timeline.steps
    run: tuple[int, int, int] | None = None  # consecutive decode steps: first, last, tokens
    for step, n in zip(life.token_steps, life.token_counts, strict=True):
        if step in life.chunks:
            continue  # the first token, with the last chunk
        mark = stalls.get(step)
        if run is not None and (mark is not None or step != run[1] + 1):
            a, b, tokens = run
            yield piece(
                "decode", "decode", start_of(a), end_of(b), steps=f"{a}..{b}", tokens=tokens
            )
            run = None
        if mark is None:
            run = (step, step, n) if run is None else (run[0], step, run[2] + n)
            continue
        begin = next((s for s in range(mark.from_step + 1, step + 1) if s in steps), step)
        yield piece(
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
        a, b, tokens = run
        yield piece("decode", "decode", start_of(a), end_of(b), steps=f"{a}..{b}", tokens=tokens)
    if life.token_steps:
        first = life.token_steps[0]
        yield instant("first token", end_of(first), step=first, ttft_ms=_ms(life.ttft))
    if life.terminal is not None and life.terminal_at is not None:
        yield instant(
            life.terminal.reason.value,
            _us(life.terminal_at),
            step=life.terminal.step,
            message=life.terminal.message,
            e2e_ms=_ms(life.e2e),
        )


def _flow(flow_id: int, cause: tuple[int, int], stall: dict[str, Any]) -> list[dict[str, Any]]:
    """An arrow from the middle of the causing step's slice to the stall's slice, ending no
    earlier than it starts (a reader matches a flow's ends in time order)."""
    start = (cause[0] + cause[1]) // 2
    end = min(max(stall["ts"] + stall["dur"] // 2, start), stall["ts"] + stall["dur"])
    common = {"name": "stalled by", "cat": "stall", "id": flow_id}
    return [
        {**common, "ph": "s", "pid": ENGINE_PID, "tid": STEPS_TID, "ts": start},
        {**common, "ph": "f", "bp": "e", "pid": REQUESTS_PID, "tid": stall["tid"], "ts": end},
    ]


def export_trace(
    path: str | Path,
    target: str | Path,
    *,
    run: int | None = None,
    model: str | None = None,
    request_ids: set[str] | None = None,
    stall_s: float | None = None,
    tracks: int = DEFAULT_TRACKS,
    progress: Callable[[int], None] | None = None,
) -> TraceStats:
    """Write one run of the log at `path` (one model of a log several share) to `target` as
    Trace Event JSON.

    `run` picks one run of a log of several (1-based), `model` one model; `request_ids` keeps
    only those requests (every step is kept); `stall_s` is the stall threshold in seconds
    (default: three times the run's median gap between tokens); `tracks` bounds the request
    tracks. Raises what `collect` raises, ValueError if `tracks` is under 1, and OSError if
    `target` cannot be written.
    """
    if tracks < 1:
        raise ValueError(f"a trace needs at least one request track, not {tracks}")
    timeline = collect(
        path, run=run, model=model, request_ids=request_ids, stall_s=stall_s, progress=progress
    )
    packing = pack_requests(timeline, step_bounds(timeline), tracks)
    other = {
        "source": "stepline replay --trace",
        "log": str(path),
        "run": run,
        "model": timeline.model,
        "stall_threshold_ms": round(timeline.stall_threshold * 1000, 3),
        "time": "integer microseconds from the run's first event",
        "request_tracks": packing.num_tracks,
        "requests": len(timeline.requests),
        "requests_not_drawn": len(timeline.requests) - packing.num_drawn,
    }
    compact = json.JSONEncoder(separators=(",", ":")).encode
    num_events = 0
    with open(target, "w", encoding="utf-8") as f:  # written as made: a big log's trace is big
        f.write('{"displayTimeUnit":"ms","otherData":' + compact(other) + ',"traceEvents":[\n')
        for event in trace_events(timeline, packing=packing):
            f.write((",\n" if num_events else "") + compact(event))
            num_events += 1
        f.write("\n]}\n")
    return TraceStats(
        num_events=num_events,
        num_steps=len(timeline.steps),
        num_requests=len(timeline.requests),
        num_stalls=len(timeline.stalls),
        stall_threshold_s=timeline.stall_threshold,
        num_tracks=packing.num_tracks,
        num_requests_drawn=packing.num_drawn,
    )


# -- the structural check --------------------------------------------------------------------


def check_trace(
    trace: dict[str, Any] | Sequence[dict[str, Any]],
    *,
    max_tracks: int | None = None,
    integer_times: bool = True,
) -> list[str]:
    """What in `trace` (a Trace Event JSON object, or its list of events) a viewer would drop
    or misdraw; empty if nothing.

    Checks: every phase is one of KNOWN_PHASES; times are numbers (integers, with
    `integer_times`); no duration is negative; on each track (pid, tid) complete and B/E
    slices nest or follow each other, never overlap partly; every E closes a B of its track
    and every B is closed; a flow starts no later than it ends and each end lies inside a
    slice of its track; at most `max_tracks` tracks (threads that hold slices or instants).
    At most 100 problems are listed, then how many more there were.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    problems: list[str] = []
    slices: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    begun: dict[tuple[Any, Any], list[tuple[float, str]]] = {}
    flows: dict[Any, dict[str, tuple[tuple[Any, Any], float]]] = {}
    tracks: set[tuple[Any, Any]] = set()
    for i, e in enumerate(events):
        ph, name = e.get("ph"), e.get("name", "")
        where = f"event {i} ({ph} {name!r})"
        if ph not in KNOWN_PHASES:
            problems.append(f"{where}: unknown phase")
            continue
        if ph == "M":
            continue
        ts = e.get("ts")
        if not _is_time(ts, integer_times):
            problems.append(f"{where}: ts {ts!r} is not {_kind(integer_times)}")
            continue
        if ph == "C":
            continue  # a counter is the process's
        track = (e.get("pid"), e.get("tid"))
        tracks.add(track)
        if ph == "X":
            dur = e.get("dur")
            if not _is_time(dur, integer_times):
                problems.append(f"{where}: dur {dur!r} is not {_kind(integer_times)}")
            elif dur < 0:
                problems.append(f"{where}: negative duration {dur}")
            else:
                slices.setdefault(track, []).append((ts, ts + dur, str(name)))
        elif ph == "B":
            begun.setdefault(track, []).append((ts, str(name)))
        elif ph == "E":
            stack = begun.get(track)
            if not stack:
                problems.append(f"{where}: an E with no B open on track {track}")
                continue
            a, opened = stack.pop()
            if ts < a:
                problems.append(f"{where}: ends at {ts}, before its B at {a}")
            else:
                slices.setdefault(track, []).append((a, ts, opened))
        elif ph in ("s", "t", "f"):
            flows.setdefault((e.get("cat"), e.get("id")), {})[ph] = (track, ts)
    for track, stack in begun.items():
        for a, opened in stack:
            problems.append(f"track {track}: B {opened!r} at {a} is never closed")
    top: dict[tuple[Any, Any], list[tuple[float, float]]] = {}
    for track, spans in slices.items():
        problems += _partial_overlaps(track, spans, top.setdefault(track, []))
    for key, ends in flows.items():
        if "s" not in ends or "f" not in ends:
            problems.append(f"flow {key}: has {sorted(ends)}, needs both s and f")
            continue
        if ends["s"][1] > ends["f"][1]:
            problems.append(f"flow {key}: ends at {ends['f'][1]}, before it starts")
        for ph, (track, ts) in ends.items():
            if not _inside(top.get(track, []), ts):
                problems.append(f"flow {key}: its {ph} at {ts} is in no slice of track {track}")
    if max_tracks is not None and len(tracks) > max_tracks:
        problems.append(f"{len(tracks)} tracks, more than {max_tracks}")
    if len(problems) > _MAX_PROBLEMS:
        more = len(problems) - _MAX_PROBLEMS
        problems = [*problems[:_MAX_PROBLEMS], f"... and {more} more"]
    return problems


def _is_time(value: Any, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (not integer and isinstance(value, float))


def _kind(integer: bool) -> str:
    return "an integer" if integer else "a number"


def _partial_overlaps(
    track: tuple[Any, Any], spans: list[tuple[float, float, str]], top: list[tuple[float, float]]
) -> list[str]:
    """Slices of one track that overlap partly (nesting is fine); fills `top` with the
    outermost slices, in time order."""
    problems = []
    spans.sort(key=lambda s: (s[0], -s[1]))
    open_: list[tuple[float, float, str]] = []  # the slices enclosing the current time
    for a, b, name in spans:
        while open_ and open_[-1][1] <= a:
            open_.pop()
        if open_ and b > open_[-1][1]:
            pa, pb, parent = open_[-1]
            problems.append(
                f"track {track}: {name!r} [{a}, {b}) overlaps {parent!r} [{pa}, {pb}) partly"
            )
            continue
        if not open_:
            top.append((a, b))
        open_.append((a, b, name))
    return problems


def _inside(top: list[tuple[float, float]], ts: float) -> bool:
    i = bisect.bisect_right(top, (ts, float("inf"))) - 1
    return i >= 0 and top[i][0] <= ts <= top[i][1]
