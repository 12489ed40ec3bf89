"""A picture of a run: a self-contained SVG (or HTML page) scheduling timeline.

Steps run along x, one row per request (in admission order): a grey line while it waits,
prefill chunks and decode tokens in different colours, checkpoints as black ticks, first
tokens and the terminal event marked. Hovering an element shows what it is (SVG <title>).
Nothing is loaded from anywhere: no scripts, fonts, images or links.

x is either the step number (one equal cell per step) or, with `time_axis`, time: a step
starts where it was planned and is as wide as the executor took (step-finished events; in
older logs, until the next plan), so idle gaps show as blank space.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stepline.events.log import read_events, read_header, read_runs
from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    FinishReason,
    StepFinished,
    StepPlanned,
    Terminal,
)

SVG_NS = "http://www.w3.org/2000/svg"  # the namespace name, not something fetched

COLOURS = {
    "prefill": "#4e79a7",
    "decode": "#59a14f",
    "waiting": "#bab0ac",
    "checkpoint": "#000000",
    "first-token": "#f1ce63",
    FinishReason.STOP.value: "#1b5e20",
    FinishReason.LENGTH.value: "#6a1b9a",
    FinishReason.CANCELLED.value: "#f28e2b",
    FinishReason.ERROR.value: "#e15759",
    FinishReason.REJECTED.value: "#9c755f",
}

_LABEL_W = 150  # px for the request ids
_ROW_H = 16
_BAR_H = 10
_TOP = 56  # legend and step axis
_MAX_PLOT_W = 1600
_LEGEND = (
    ("waiting", "waiting"),
    ("prefill chunk", "prefill"),
    ("decode", "decode"),
    ("first token", "first-token"),
    ("checkpoint", "checkpoint"),
    ("stop", "stop"),
    ("length", "length"),
    ("cancelled", "cancelled"),
    ("error", "error"),
    ("rejected", "rejected"),
)
_LEGEND_W = 4 + sum(14 + 7 * len(label) + 12 for label, _ in _LEGEND)


@dataclass
class _Row:
    request_id: str
    admitted_step: int
    num_prompt_tokens: int
    prefill: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> [start, end)
    decode_steps: list[tuple[int, int]] = field(default_factory=list)  # (step, num tokens)
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (step, offset)
    terminal: Terminal | None = None

    @property
    def first_active_step(self) -> int | None:
        candidates = [*self.prefill, *(s for s, _ in self.decode_steps[:1])]
        if self.terminal is not None:
            candidates.append(self.terminal.step)
        return min(candidates) if candidates else None


@dataclass
class _Times:
    planned: dict[int, float] = field(default_factory=dict)  # step -> when it was planned
    seconds: dict[int, float] = field(default_factory=dict)  # step -> executor time


def _collect(
    path: str | Path,
    first: int | None,
    last: int | None,
    request_ids: set[str] | None,
    run: int | None,
    times: _Times,
) -> tuple[list[_Row], int, int]:
    rows: dict[str, _Row] = {}
    lo: int | None = None
    hi: int | None = None
    for event in read_events(path, run=run):
        if last is not None and event.step > last + 1:
            break
        if isinstance(event, StepPlanned):
            times.planned[event.step] = event.ts
            continue
        if isinstance(event, StepFinished):
            times.seconds[event.step] = event.seconds
            continue
        if last is not None and event.step > last:
            continue
        lo = event.step if lo is None else min(lo, event.step)
        hi = event.step if hi is None else max(hi, event.step)
        rid = event.request_id
        if request_ids is not None and rid not in request_ids:
            continue
        if isinstance(event, Admitted):
            rows.setdefault(rid, _Row(rid, event.step, event.num_prompt_tokens))
            continue
        row = rows.get(rid)
        if row is None or row.terminal is not None:
            continue  # verify's business, not the picture's
        if isinstance(event, ChunkPrefilled):
            start, _ = row.prefill.get(event.step, (event.start, event.end))
            row.prefill[event.step] = (start, event.end)  # a chunk split at a checkpoint
        elif isinstance(event, Decoding):
            row.decode_steps.append((event.step, len(event.token_ids)))
        elif isinstance(event, CheckpointReached):
            row.checkpoints.append((event.step, event.offset))
        elif isinstance(event, Terminal):
            row.terminal = event
    lo = first if first is not None else (lo or 0)
    hi = last if last is not None else (hi if hi is not None else lo)
    hi = max(hi, lo)
    visible = [
        r
        for r in rows.values()
        if r.admitted_step <= hi and (r.terminal is None or r.terminal.step >= lo)
    ]
    return visible, lo, hi


def _decode_runs(row: _Row, merge: bool = True) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Consecutive decode steps merged: (from, to, tokens); and steps where a first token
    came with the final prefill chunk (drawn as a marker on that chunk)."""
    runs: list[tuple[int, int, int]] = []
    first_tokens: list[int] = []
    for step, n in row.decode_steps:
        if step in row.prefill:
            first_tokens.append(step)
            continue
        if merge and runs and runs[-1][1] + 1 >= step:
            a, _, tokens = runs[-1]
            runs[-1] = (a, step, tokens + n)
        else:
            runs.append((step, step, n))
    return runs, first_tokens


def _step_edges(lo: int, hi: int, times: _Times) -> tuple[dict[int, float], dict[int, float]]:
    """Each step's start and end in seconds from step `lo`'s plan (for the time axis)."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    t0 = times.planned.get(lo)
    if t0 is None:
        t0 = min((t for s, t in times.planned.items() if s >= lo), default=0.0)
    cursor = 0.0
    for step in range(lo, hi + 1):
        planned = times.planned.get(step)
        start = cursor if planned is None else max(cursor, planned - t0)
        if step in times.seconds:
            seconds = times.seconds[step]
        elif planned is not None and step + 1 in times.planned:
            seconds = times.planned[step + 1] - planned  # older logs: until the next plan
        else:
            seconds = 0.0
        starts[step], ends[step] = start, start + seconds
        cursor = ends[step]
    return starts, ends


def _nice_seconds(total: float) -> float:
    for tick in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60):
        if total / tick <= 12:
            return float(tick)
    return max(1.0, round(total / 10))


def _nice_tick(num_steps: int, cell_w: float) -> int:
    for tick in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000):
        if tick * cell_w >= 60:
            return tick
    return max(1, num_steps // 10)


def _a(value: object) -> str:
    return html.escape(str(value), quote=True)


def render_svg(
    path: str | Path,
    *,
    first_step: int | None = None,
    last_step: int | None = None,
    request_ids: set[str] | None = None,
    max_rows: int = 2000,
    xmlns: bool = True,
    run: int | None = None,
    time_axis: bool = False,
) -> str:
    """The timeline of the log at `path` as an SVG document (steps first..last, inclusive).

    One row per request (those in `request_ids`, if given), at most `max_rows` (a note says
    how many were left out). `run` picks one run of a log that holds several (1-based);
    `time_axis` lays steps out by time. Raises what `read_events` raises.
    """
    times = _Times()
    rows, lo, hi = _collect(path, first_step, last_step, request_ids, run, times)
    left_out = max(0, len(rows) - max_rows)
    rows = rows[:max_rows]
    num_steps = hi - lo + 1
    xa: Callable[[int], float]  # a step's left edge
    xb: Callable[[int], float]  # its right edge
    if time_axis:
        starts, ends = _step_edges(lo, hi, times)
        total = max(ends[hi], 1e-6)
        plot_w = float(_MAX_PLOT_W)
        scale = plot_w / total

        def xa(step: int) -> float:
            return round(_LABEL_W + starts[min(step, hi)] * scale, 2)

        def xb(step: int) -> float:
            # at least a hairline, so a step that took no measurable time still shows
            return round(max(_LABEL_W + ends[min(step, hi)] * scale, xa(step) + 0.5), 2)

    else:
        cw = min(24.0, max(0.25, _MAX_PLOT_W / num_steps))
        plot_w = num_steps * cw

        def xa(step: int) -> float:
            return round(_LABEL_W + (step - lo) * cw, 2)

        def xb(step: int) -> float:
            return round(_LABEL_W + (step - lo + 1) * cw, 2)

    width = int(max(_LABEL_W + plot_w + 20, _LEGEND_W))
    height = int(_TOP + max(1, len(rows)) * _ROW_H + (20 if left_out else 6))

    out: list[str] = []
    ns = f' xmlns="{SVG_NS}"' if xmlns else ""
    out.append(
        f'<svg{ns} width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="monospace" font-size="11">'
    )
    axis = "time" if time_axis else "steps"
    out.append(f"<title>stepline timeline: {_a(Path(path).name)} steps {lo}..{hi} ({axis})</title>")
    out.append(f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>')

    # Legend.
    lx = 4
    for label, key in _LEGEND:
        out.append(f'<rect x="{lx}" y="6" width="10" height="10" fill="{COLOURS[key]}"/>')
        out.append(f'<text x="{lx + 14}" y="15">{label}</text>')
        lx += 14 + 7 * len(label) + 12

    # Axis and grid.
    grid_bottom = _TOP + len(rows) * _ROW_H
    if time_axis:
        tick_s = _nice_seconds(total)
        k = 0
        while k * tick_s <= total + 1e-9:
            gx = round(_LABEL_W + k * tick_s * scale, 2)
            out.append(
                f'<line x1="{gx}" y1="{_TOP - 6}" x2="{gx}" y2="{grid_bottom}" stroke="#e6e6e6"/>'
            )
            out.append(f'<text x="{gx}" y="{_TOP - 10}">{k * tick_s:g}</text>')
            k += 1
        out.append(f'<text x="4" y="{_TOP - 10}">seconds</text>')
    else:
        tick = _nice_tick(num_steps, cw)
        first_tick = lo + (-lo) % tick
        for step in range(first_tick, hi + 1, tick):
            gx = xa(step)
            out.append(
                f'<line x1="{gx}" y1="{_TOP - 6}" x2="{gx}" y2="{grid_bottom}" stroke="#e6e6e6"/>'
            )
            out.append(f'<text x="{gx}" y="{_TOP - 10}">{step}</text>')
        out.append(f'<text x="4" y="{_TOP - 10}">step</text>')

    for i, row in enumerate(rows):
        y = _TOP + i * _ROW_H
        bar_y = y + (_ROW_H - _BAR_H) / 2
        mid = y + _ROW_H / 2
        rid = _a(row.request_id)
        label = row.request_id if len(row.request_id) <= 20 else row.request_id[:19] + "…"
        out.append(f'<g class="request" data-request-id="{rid}">')
        out.append(f'<text x="4" y="{y + 12}"><title>{rid}</title>{_a(label)}</text>')

        start = row.first_active_step
        wait_end = start if start is not None else (hi + 1)
        if wait_end > row.admitted_step:
            a, b = max(row.admitted_step, lo), min(wait_end, hi + 1)
            if b > a:
                out.append(
                    f'<line x1="{xa(a)}" y1="{mid}" x2="{xb(b - 1)}" y2="{mid}" '
                    f'stroke="{COLOURS["waiting"]}" stroke-width="2">'
                    f"<title>{rid}: waiting from step {row.admitted_step}</title></line>"
                )
        for step, (a, b) in row.prefill.items():
            if lo <= step <= hi:
                out.append(
                    f'<rect x="{xa(step)}" y="{bar_y}" width="{round(xb(step) - xa(step), 2)}" '
                    f'height="{_BAR_H}" '
                    f'fill="{COLOURS["prefill"]}" stroke="#ffffff" stroke-width="0.5">'
                    f"<title>{rid}: prefill [{a}, {b}) of {row.num_prompt_tokens} "
                    f"at step {step}</title></rect>"
                )
        # On a time axis a run of decode steps is not one bar: idle time may lie between them.
        runs, first_tokens = _decode_runs(row, merge=not time_axis)
        for a, b, n in runs:
            a, b = max(a, lo), min(b, hi)
            if b >= a:
                out.append(
                    f'<rect x="{xa(a)}" y="{bar_y}" width="{round(xb(b) - xa(a), 2)}" '
                    f'height="{_BAR_H}" fill="{COLOURS["decode"]}">'
                    f"<title>{rid}: decoding steps {a}..{b}, {n} tokens</title></rect>"
                )
        for step in first_tokens:
            if lo <= step <= hi:
                w = xb(step) - xa(step)
                out.append(
                    f'<rect x="{round(xa(step) + w * 0.6, 2)}" y="{bar_y}" '
                    f'width="{round(w * 0.4, 2)}" height="{_BAR_H}" '
                    f'fill="{COLOURS["first-token"]}">'
                    f"<title>{rid}: first token at step {step}</title></rect>"
                )
        for step, offset in row.checkpoints:
            if lo <= step <= hi:
                cx = xb(step)
                out.append(
                    f'<polygon points="{cx - 3},{y} {cx + 3},{y} {cx},{bar_y + 3}" '
                    f'fill="{COLOURS["checkpoint"]}">'
                    f"<title>{rid}: checkpoint at prompt offset {offset} (step {step})"
                    "</title></polygon>"
                )
        t = row.terminal
        if t is not None and lo <= t.step <= hi:
            tx = xb(t.step)
            msg = f" ({t.message})" if t.message else ""
            out.append(
                f'<rect x="{tx}" y="{y + 1}" width="3" height="{_ROW_H - 2}" '
                f'fill="{COLOURS[t.reason.value]}">'
                f"<title>{rid}: {t.reason.value}{_a(msg)} at step {t.step}</title></rect>"
            )
        out.append("</g>")
    if left_out:
        out.append(
            f'<text x="4" y="{grid_bottom + 14}">… and {left_out} more requests not drawn '
            "(narrow the steps or pick requests)</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_html(
    path: str | Path,
    *,
    first_step: int | None = None,
    last_step: int | None = None,
    request_ids: set[str] | None = None,
    max_rows: int = 2000,
    run: int | None = None,
    time_axis: bool = False,
) -> str:
    """The same timeline in a self-contained HTML page (inline SVG, inline style)."""
    header = read_header(path) if run is None else read_runs(path)[run - 1].header
    svg = render_svg(
        path,
        first_step=first_step,
        last_step=last_step,
        request_ids=request_ids,
        max_rows=max_rows,
        xmlns=False,
        run=run,
        time_axis=time_axis,
    )
    config = ", ".join(f"{k}={v}" for k, v in sorted(header.config.items()))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>stepline replay: {_a(Path(path).name)}</title>\n"
        "<style>body{font-family:system-ui,sans-serif;margin:1em}"
        "div.scroll{overflow:auto;border:1px solid #ddd}</style>\n</head>\n<body>\n"
        f"<h1>{_a(Path(path).name)}</h1>\n"
        f"<p>model {_a(header.model)} · {_a(config)}</p>\n"
        f'<div class="scroll">\n{svg}</div>\n</body>\n</html>\n'
    )
