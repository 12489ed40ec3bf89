"""A picture of a run that shows why a request was slow: a self-contained SVG (or HTML page).

From the top: a heading (the log, the steps shown, how many requests and stalls), for one
request its figures (TTFT, queue time, prefill chunks, worst gap, cached tokens), then the
**step-time strip**: one bar per step as tall as the executor took, with the scheduler's
prediction as a tick, steps that carried prefill chunks in blue and steps that stalled
someone in red, and the step-time target the run was configured with (`max_step_ms` in the
log header's config) as a dashed line across it. Below it one row per request: a grey line
while it waits, its prefill chunks and decode tokens, step boundaries where steps are wide
enough to show them, every gap between two of its tokens above the stall threshold in red
(its hover text names the step that caused it), its first token as a diamond where it came
out, checkpoints and its end.
Every element says what it is, with its times, on hover (SVG <title>). Nothing is loaded
from anywhere: no scripts, fonts, images or links.

A run with more requests than `top` is summarised: the `top` requests that waited longest
for a token are drawn, slowest first, and the rest folded into one line; steps narrower than
a pixel are drawn as buckets (each as tall as its slowest step), so a log of any size gives
a picture of bounded size.

x is either the step number (one equal cell per step) or, with `time_axis`, time: a step is
as wide as the executor took it, so idle gaps show as blank space.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stepline.events.log import read_header, read_runs
from stepline.events.models import FinishReason
from stepline.events.replay.timeline import RequestLife, RunTimeline, StallMark, StepSpan, collect
from stepline.events.replay.timeline import format_ms as _ms

SVG_NS = "http://www.w3.org/2000/svg"  # the namespace name, not something fetched

COLOURS = {
    "prefill": "#4e79a7",
    "encode": "#76b7b2",
    "decode": "#59a14f",
    "waiting": "#bab0ac",
    "checkpoint": "#000000",
    "first-token": "#f1ce63",
    "stall": "#e15759",
    "step": "#9aa5b1",
    "predicted": "#222222",
    "target": "#6a3d9a",
    FinishReason.STOP.value: "#1b5e20",
    FinishReason.LENGTH.value: "#6a1b9a",
    FinishReason.LOOP.value: "#ad1457",
    FinishReason.CANCELLED.value: "#f28e2b",
    FinishReason.ERROR.value: "#b71c1c",
    FinishReason.REJECTED.value: "#9c755f",
}

_ROW_H = 18
_BAR_H = 10
_PLOT_W = 1600
_STRIP_H = 64
_WAIT_W = 90  # the column of each row's longest wait, right of the plot
_CHAR_W = 6.7  # monospace at font-size 11
_MAX_STALLS_PER_ROW = 12
_MAX_CONTEXT_ROWS = 3
_STEP_TICKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000)
_LEGEND = (
    ("waiting", "waiting"),
    ("prefill chunk", "prefill"),
    ("image encoder", "encode"),
    ("decode", "decode"),
    ("first token", "first-token"),
    ("stall", "stall"),
    ("checkpoint", "checkpoint"),
    ("stop", "stop"),
    ("length", "length"),
    ("loop", "loop"),
    ("cancelled", "cancelled"),
    ("error", "error"),
    ("rejected", "rejected"),
)
_LEGEND_W = 4 + sum(14 + 7 * len(label) + 12 for label, _ in _LEGEND)


def _a(value: object) -> str:
    return html.escape(str(value), quote=True)


def _r(x: float) -> float:
    return round(x, 2)


@dataclass
class _Axis:
    """Where steps and times fall on x."""

    lo: int
    hi: int
    left: float
    xa: Callable[[int], float]  # a step's left edge
    xb: Callable[[int], float]  # its right edge
    xt: Callable[[float], float]  # a time (seconds from the run's first event)
    ticks: list[tuple[float, str]]
    unit: str


def _axis(
    timeline: RunTimeline, lo: int, hi: int, left: float, time_axis: bool, zoomed: bool
) -> _Axis:
    shown = [timeline.steps[s] for s in range(lo, hi + 1) if s in timeline.steps]
    if time_axis and shown:
        return _time_axis(timeline.steps, shown, lo, hi, left)
    # A request's picture fills the width; a run's keeps cells narrow enough to read as one.
    return _step_axis(shown, lo, hi, left, _PLOT_W / 10 if zoomed else 24.0)


def _time_axis(
    steps: dict[int, StepSpan], shown: list[StepSpan], lo: int, hi: int, left: float
) -> _Axis:
    t_lo = shown[0].start
    total = max(max(s.end for s in shown) - t_lo, 1e-6)
    scale = _PLOT_W / total

    def xt(t: float) -> float:
        return _r(left + min(max(t - t_lo, 0.0), total) * scale)

    def xa(step: int) -> float:
        span = steps.get(step)
        if span is None:
            return left if step <= lo else xt(total + t_lo)
        return xt(span.start)

    def xb(step: int) -> float:
        span = steps.get(step)
        if span is None:
            return xa(step)
        # at least a hairline, so a step that took no measurable time still shows
        return _r(max(xt(span.end), xa(step) + 0.5))

    tick = _nice(total, (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10))
    ticks = [(xt(t_lo + k * tick), f"{k * tick:g}") for k in range(int(total / tick) + 1)]
    return _Axis(lo, hi, left, xa, xb, xt, ticks, "seconds")


def _step_axis(shown: list[StepSpan], lo: int, hi: int, left: float, max_cell: float) -> _Axis:
    num_steps = hi - lo + 1
    cw = min(max_cell, _PLOT_W / num_steps)

    def xa(step: int) -> float:
        return _r(left + (min(max(step, lo), hi + 1) - lo) * cw)

    def xb(step: int) -> float:
        return _r(left + (min(max(step, lo - 1), hi) - lo + 1) * cw)

    starts = [s.start for s in shown]

    def xt(t: float) -> float:  # in the step it fell in: its left edge, or its right after it
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return xa(lo)
        return xb(shown[i].step) if t >= shown[i].end else xa(shown[i].step)

    tick = next((t for t in _STEP_TICKS if t * cw >= 50), max(1, num_steps // 10))
    later = range(lo + (-lo) % tick or tick, hi + 1, tick)
    ticks = [(xa(s), str(s)) for s in (lo, *(s for s in later if s - lo >= tick / 2))]
    return _Axis(lo, hi, left, xa, xb, xt, ticks, "step")


def _nice(total: float, candidates: tuple[float, ...]) -> float:
    for tick in candidates:
        if total / tick <= 12:
            return float(tick)
    return float(max(candidates[-1], round(total / 10)))


def _range(
    timeline: RunTimeline, first: int | None, last: int | None, zoom: list[RequestLife]
) -> tuple[int, int]:
    """The steps to draw: those asked for, else the zoomed requests' lives, else the run."""
    if zoom and first is None and last is None:  # a request's life, from admission to its end
        lo = max(min(r.admitted_step for r in zoom), timeline.first_step or 0)
        hi = max(r.last_step for r in zoom)
        return lo, max(hi, lo)
    lo = first if first is not None else (timeline.first_step or 0)
    hi = last if last is not None else (timeline.last_step or lo)
    return lo, max(hi, lo)


def render_svg(
    path: str | Path,
    *,
    first_step: int | None = None,
    last_step: int | None = None,
    request_ids: set[str] | None = None,
    top: int = 25,
    xmlns: bool = True,
    run: int | None = None,
    model: str | None = None,
    time_axis: bool = False,
    stall_s: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """The timeline of the log at `path` as an SVG document (steps first..last, inclusive).

    With `request_ids`, only those requests, zoomed to their lives unless steps are given.
    Otherwise, past `top` requests, the `top` that waited longest for a token are drawn and
    the rest folded. `run` picks one run of a log that holds several (1-based), `model` one
    model of a log several share; `time_axis` lays steps out by time; `stall_s` is the stall
    threshold (default: three times the median gap between tokens). Raises what `collect`
    raises.
    """
    # Every request is collected, drawn or not: the strip shows whom each step stalled.
    timeline = collect(path, run=run, model=model, stall_s=stall_s, progress=progress)
    target = step_time_target(_run_config(path, run, timeline)[1])
    picture = _Picture(timeline, first_step, last_step, request_ids, top, time_axis, target)
    return picture.svg(xmlns)


def _run_config(path: str | Path, run: int | None, timeline: RunTimeline) -> tuple[str, dict]:
    """The model and the config the run was started with (in a log several models share:
    the model's first load's)."""
    header = read_header(path) if run is None else read_runs(path)[run - 1].header
    name, config = header.model, header.config
    if timeline.model is not None and header.models:
        loaded = timeline.loaded
        name = f"{timeline.model} ({loaded.path})" if loaded is not None else timeline.model
        config = loaded.config if loaded is not None else {}
    return name, config


def step_time_target(config: dict) -> float | None:
    """The step-time target in seconds (`max_step_ms`), or None where the run had none (0, or
    a log written before the option)."""
    ms = config.get("max_step_ms")
    return ms / 1000 if isinstance(ms, int | float) and ms > 0 else None


class _Picture:
    def __init__(
        self,
        timeline: RunTimeline,
        first: int | None,
        last: int | None,
        request_ids: set[str] | None,
        top: int,
        time_axis: bool,
        target: float | None = None,
    ) -> None:
        self.t = timeline
        self.target = target  # the step-time target, seconds
        picked = [r for r in timeline.requests.values() if r.request_id in (request_ids or ())]
        self.lo, self.hi = _range(timeline, first, last, picked)
        lo, hi = self.lo, self.hi
        candidates = picked if request_ids is not None else timeline.requests.values()
        visible = [r for r in candidates if r.admitted_step <= hi and r.last_step >= lo]
        self.num_visible = len(visible)
        self.zoomed = request_ids is not None
        if not self.zoomed and len(visible) > top:
            visible = sorted(visible, key=lambda r: (-r.longest_wait, r.order))[:top]
        self.rows = visible
        # Beside a request, the requests whose prefill chunks were in the steps that stalled it.
        self.context: list[RequestLife] = []
        if self.zoomed:
            causes = [
                timeline.steps[m.cause_step]
                for r in visible
                for m in r.stalls
                if m.cause_step is not None and lo <= m.cause_step <= hi
            ]
            named = dict.fromkeys(rid for span in causes for rid, _ in span.prefills)
            self.context = [
                timeline.requests[rid]
                for rid in named
                if rid in timeline.requests and rid not in (request_ids or ())
            ][:_MAX_CONTEXT_ROWS]
        self.folded = self.num_visible - len(visible)
        longest_id = max((len(r.request_id) for r in (*self.rows, *self.context)), default=8)
        self.left = max(110.0, _r(longest_id * _CHAR_W + 12))
        self.axis = _axis(timeline, lo, hi, self.left, time_axis, self.zoomed)
        self.causes = timeline.causing_steps()
        drawn = {r.request_id for r in self.rows} if self.zoomed else None
        self.stalls_shown = [
            s
            for s in timeline.stalls
            if lo <= s.to_step <= hi and (drawn is None or s.request_id in drawn)
        ]

    # -- layout -----------------------------------------------------------------------------

    def svg(self, xmlns: bool) -> str:
        t, axis = self.t, self.axis
        plot_right = _r(axis.xb(self.hi))
        facts = [f"{r.request_id}: {r.describe()}" for r in self.rows if self.zoomed]
        if not self.zoomed and self.stalls_shown:
            facts.append(self.stalling_steps())
        lines = [self.heading(), *facts]
        text_w = max(len(line) for line in lines) * _CHAR_W + 8
        target_w = len(f"target {_ms(self.target)}") * _CHAR_W + 12 if self.target else 0.0
        width = int(max(plot_right + max(_WAIT_W + 10, target_w), _LEGEND_W, text_w))
        heading_y = 38
        facts_y = heading_y + 16
        ticks_y = facts_y + 16 * len(facts) + 14
        self.strip_top = ticks_y + 8
        self.strip_bottom = self.strip_top + _STRIP_H
        self.rows_top = self.strip_bottom + 14
        self.context_top = self.rows_top + len(self.rows) * _ROW_H + (18 if self.context else 0)
        grid_bottom = self.context_top + len(self.context) * _ROW_H
        height = int(grid_bottom + (24 if self.folded else 8))

        out: list[str] = []
        ns = f' xmlns="{SVG_NS}"' if xmlns else ""
        out.append(
            f'<svg{ns} width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            'font-family="monospace" font-size="11">'
        )
        name = _a(Path(t.path).name)
        out.append(
            f"<title>stepline timeline: {name} steps {self.lo}..{self.hi} ({axis.unit})</title>"
        )
        out.append(f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>')
        lx = 4
        for label, key in _LEGEND:
            out.append(f'<rect x="{lx}" y="6" width="10" height="10" fill="{COLOURS[key]}"/>')
            out.append(f'<text x="{lx + 14}" y="15">{label}</text>')
            lx += 14 + 7 * len(label) + 12

        out.append(f'<text x="4" y="{heading_y}" font-weight="bold">{_a(self.heading())}</text>')
        for i, line in enumerate(facts):
            out.append(f'<text x="4" y="{facts_y + 16 * i}">{_a(line)}</text>')

        for gx, label in axis.ticks:
            out.append(
                f'<line x1="{gx}" y1="{ticks_y + 2}" x2="{gx}" y2="{grid_bottom}" '
                'stroke="#ececec"/>'
            )
            out.append(f'<text x="{gx + 2}" y="{ticks_y}">{label}</text>')
        out.append(f'<text x="4" y="{ticks_y}">{axis.unit}</text>')
        out.append(f'<text x="{plot_right + 8}" y="{ticks_y}">longest wait</text>')

        out.extend(self.strip())
        for i, row in enumerate(self.rows):
            out.extend(self.row(row, self.rows_top + i * _ROW_H))
        if self.context:
            out.append(
                f'<text x="4" y="{self.context_top - 5}" fill="#555555">what stalled it: the '
                "prefills in those steps</text>"
            )
        for i, row in enumerate(self.context):
            out.extend(self.row(row, self.context_top + i * _ROW_H, kind="context"))
        if self.folded:
            out.append(
                f'<text x="4" y="{grid_bottom + 16}">… and {self.folded} more requests folded: '
                f"each waited at most {_ms(self.fold_limit())} for a token (--top N draws more; "
                "--request ID shows one)</text>"
            )
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def heading(self) -> str:
        t = self.t
        stalls = self.stalls_shown
        text = (
            f"{Path(t.path).name}{f' (model {t.model})' if t.model else ''}: steps "
            f"{self.lo}..{self.hi}, {self.num_visible} request{'s' * (self.num_visible != 1)}"
        )
        if self.folded:
            text += f" (the {len(self.rows)} that waited longest for a token drawn, slowest first)"
        median = f", median gap {_ms(t.median_gap)}" if t.median_gap is not None else ""
        text += f"; stalls over {_ms(t.stall_threshold)}{median}: {len(stalls)}"
        if stalls:
            worst = stalls[0]
            at = f" at step {worst.cause_step}" if worst.cause_step is not None else ""
            text += f", worst {_ms(worst.seconds)} ({worst.request_id}{at})"
        return text

    def stalling_steps(self, limit: int = 5) -> str:
        """The steps that cost requests the most waiting, e.g. 'steps that stalled requests
        longest: 9 (3 requests, took 141.0 ms), ...'."""
        stalled: dict[int, list[float]] = {}
        for mark in self.stalls_shown:
            if mark.cause_step is not None:
                stalled.setdefault(mark.cause_step, []).append(mark.seconds)
        worst = sorted(stalled.items(), key=lambda kv: (-sum(kv[1]), kv[0]))[:limit]
        shown = ", ".join(
            f"{step} ({len(gaps)} request{'s' * (len(gaps) != 1)}, took "
            f"{_ms(self.t.steps[step].seconds)})"
            for step, gaps in worst
        )
        return f"steps that stalled requests longest: {shown}"

    def fold_limit(self) -> float:
        drawn = {r.request_id for r in self.rows}
        return max(
            (
                r.longest_wait
                for r in self.t.requests.values()
                if r.request_id not in drawn and r.admitted_step <= self.hi
            ),
            default=0.0,
        )

    # -- the step-time strip ----------------------------------------------------------------

    def strip(self) -> list[str]:
        axis, top, bottom = self.axis, self.strip_top, self.strip_bottom
        spans = [self.t.steps[s] for s in range(self.lo, self.hi + 1) if s in self.t.steps]
        out = ['<g class="steps">']
        slowest = max((max(s.seconds, s.predicted or 0.0) for s in spans), default=0.0)
        tallest = max(slowest, self.target or 0.0) if spans else 0.0  # the target in view
        out.append(f'<text x="4" y="{top + 10}">step time</text>')
        out.append(f'<text x="4" y="{top + 24}">max {_ms(slowest)}</text>')
        if any(span.estimated for span in spans):  # a log written before step-finished events
            out.append(f'<text x="4" y="{top + 38}">(estimated)</text>')
        out.append(
            f'<line x1="{self.left}" y1="{bottom}" x2="{axis.xb(self.hi)}" y2="{bottom}" '
            'stroke="#888888"/>'
        )
        if tallest <= 0:
            out.append("</g>")
            return out

        def height(seconds: float) -> float:
            return _r(_STRIP_H * seconds / tallest)

        for group in _buckets(spans, axis):
            worst = max(group, key=lambda s: s.seconds)
            x0 = axis.xa(group[0].step)
            x1 = max(axis.xb(group[-1].step), x0 + 1)
            caused = [m for s in group for m in self.causes.get(s.step, ())]
            if caused:
                fill = COLOURS["stall"]
            elif any(s.num_chunk_tokens for s in group):
                fill = COLOURS["prefill"]
            elif any(s.encodes for s in group):
                fill = COLOURS["encode"]
            else:
                fill = COLOURS["step"]
            h = max(height(worst.seconds), 0.5)
            title = worst.describe()
            if len(group) > 1:
                title = f"steps {group[0].step}..{group[-1].step} ({len(group)}): slowest {title}"
            if caused:
                title += "; stalled " + _stalled(caused)
            out.append(
                f'<rect x="{x0}" y="{_r(bottom - h)}" width="{_r(x1 - x0)}" height="{h}" '
                f'fill="{fill}" data-step="{worst.step}"><title>{_a(title)}</title></rect>'
            )
            if len(group) == 1 and worst.predicted is not None and x1 - x0 >= 2:
                py = _r(bottom - height(worst.predicted))
                out.append(
                    f'<line x1="{x0}" y1="{py}" x2="{_r(x1)}" y2="{py}" '
                    f'stroke="{COLOURS["predicted"]}" stroke-width="1.5">'
                    f"<title>step {worst.step} predicted {_ms(worst.predicted)}</title></line>"
                )
        if self.target is not None:
            gy = _r(bottom - height(self.target))
            over = sum(s.seconds > self.target for s in spans)
            out.append(
                f'<line class="target" x1="{self.left}" y1="{gy}" x2="{axis.xb(self.hi)}" '
                f'y2="{gy}" stroke="{COLOURS["target"]}" stroke-dasharray="6,3" '
                f'stroke-width="1.2"><title>step-time target {_ms(self.target)} (max_step_ms): '
                f"prefill chunks are sized to keep a step under it; {over} of {len(spans)} "
                "steps took longer</title></line>"
            )
            out.append(  # right of the plot: the stall threshold's label is on the left
                f'<text x="{axis.xb(self.hi) + 8}" y="{gy + 4}" fill="{COLOURS["target"]}">'
                f"target {_ms(self.target)}</text>"
            )
        threshold = self.t.stall_threshold
        if 0 < threshold <= tallest:
            ty = _r(bottom - height(threshold))
            out.append(
                f'<line x1="{self.left}" y1="{ty}" x2="{axis.xb(self.hi)}" y2="{ty}" '
                f'stroke="{COLOURS["stall"]}" stroke-dasharray="4,3" stroke-width="0.8">'
                f"<title>stall threshold {_ms(threshold)}</title></line>"
            )
            out.append(
                f'<text x="4" y="{ty + 4}" fill="{COLOURS["stall"]}">stall {_ms(threshold)}</text>'
            )
        out.append("</g>")
        return out

    # -- one request ------------------------------------------------------------------------

    def row(self, row: RequestLife, y: float, kind: str = "request") -> list[str]:
        axis, lo, hi = self.axis, self.lo, self.hi
        bar_y = y + (_ROW_H - _BAR_H) / 2
        mid = y + _ROW_H / 2
        rid = _a(row.request_id)
        out = [f'<g class="{kind}" data-request-id="{rid}">']
        out.append(
            f'<text x="4" y="{y + 13}">{rid}<title>{rid}: {_a(row.describe())}</title></text>'
        )
        plot_right = axis.xb(hi)
        out.append(
            f'<text x="{plot_right + 8}" y="{y + 13}">{_ms(row.longest_wait)}'
            f"<title>{rid}: the longest it waited for a token (TTFT or a gap)</title></text>"
        )

        start = row.first_active_step
        wait_from = axis.xt(row.admitted_at) if row.admitted_step >= lo else self.left
        wait_to = axis.xa(start) if start is not None else plot_right
        if start is None or start >= lo:
            if wait_to > wait_from:
                out.append(
                    f'<line x1="{wait_from}" y1="{mid}" x2="{wait_to}" y2="{mid}" '
                    f'stroke="{COLOURS["waiting"]}" stroke-width="2">'
                    f"<title>{rid}: waiting from step {row.admitted_step}, queued "
                    f"{_ms(row.queued)}</title></line>"
                )
        for step, (a, b) in row.chunks.items():
            if lo <= step <= hi:
                took = self._took(step)
                out.append(
                    f'<rect x="{axis.xa(step)}" y="{bar_y}" '
                    f'width="{_r(axis.xb(step) - axis.xa(step))}" height="{_BAR_H}" '
                    f'fill="{COLOURS["prefill"]}">'
                    f"<title>{rid}: prefill [{a}, {b}) of {row.num_prompt_tokens} "
                    f"at step {step}{took}</title></rect>"
                )
        for a, b, n, seconds in self._decode_runs(row):
            out.append(
                f'<rect x="{axis.xa(a)}" y="{bar_y}" width="{_r(axis.xb(b) - axis.xa(a))}" '
                f'height="{_BAR_H}" fill="{COLOURS["decode"]}">'
                f"<title>{rid}: decoding steps {a}..{b}, {n} tokens in {_ms(seconds)}"
                "</title></rect>"
            )
        out.extend(self._boundaries(row, bar_y))
        for mark in row.stalls[:_MAX_STALLS_PER_ROW]:
            if lo <= mark.to_step <= hi:
                out.extend(self._stall(mark, bar_y))
        for step, offset in row.checkpoints:
            if lo <= step <= hi:
                cx = axis.xb(step)
                out.append(
                    f'<polygon points="{cx - 3},{y} {cx + 3},{y} {cx},{bar_y + 3}" '
                    f'fill="{COLOURS["checkpoint"]}">'
                    f"<title>{rid}: checkpoint at prompt offset {offset} (step {step})"
                    "</title></polygon>"
                )
        if row.token_steps and lo <= row.token_steps[0] <= hi:
            step = row.token_steps[0]
            fx = axis.xb(step)
            out.append(
                f'<polygon class="first-token" points="{fx - 5},{mid} {fx},{mid - 6} '
                f'{fx + 5},{mid} {fx},{mid + 6}" fill="{COLOURS["first-token"]}" '
                'stroke="#7a5c00" stroke-width="1">'
                f"<title>{rid}: first token at step {step}: TTFT {_ms(row.ttft)} (queued "
                f"{_ms(row.queued)})</title></polygon>"
            )
        term = row.terminal
        if term is not None and lo <= term.step <= hi:
            tx = axis.xb(term.step)
            msg = f" ({term.message})" if term.message else ""
            out.append(
                f'<rect x="{tx}" y="{y + 2}" width="3" height="{_ROW_H - 4}" '
                f'fill="{COLOURS[term.reason.value]}">'
                f"<title>{rid}: {term.reason.value}{_a(msg)} at step {term.step}, "
                f"{_ms(row.e2e)} after admission</title></rect>"
            )
        out.append("</g>")
        return out

    def _took(self, step: int) -> str:
        span = self.t.steps.get(step)
        return "" if span is None else f" (the step took {_ms(span.seconds)})"

    def _decode_runs(self, row: RequestLife) -> list[tuple[int, int, int, float]]:
        """Consecutive decode steps with no blank between them: (from, to, tokens, seconds).
        The first token comes with the last prefill chunk: it is a marker, not a bar."""
        axis = self.axis
        runs: list[tuple[int, int, int, float]] = []
        for step, n in zip(row.token_steps, row.token_counts, strict=True):
            if step in row.chunks or not self.lo <= step <= self.hi:
                continue
            span = self.t.steps.get(step)
            seconds = span.seconds if span is not None else 0.0
            if runs and runs[-1][1] + 1 == step and axis.xa(step) - axis.xb(runs[-1][1]) < 1:
                a, _, tokens, total = runs[-1]
                runs[-1] = (a, step, tokens + n, total + seconds)
            else:
                runs.append((step, step, n, seconds))
        return runs

    def _boundaries(self, row: RequestLife, bar_y: float) -> list[str]:
        """A white hairline at the start of each of the row's steps, where steps are wide
        enough (4 px) for lines not to merge into a block."""
        axis = self.axis
        steps = sorted({*row.chunks, *row.token_steps})[1:]  # the first has its row's edge
        xs = [axis.xa(s) for s in steps if self.lo <= s <= self.hi and axis.xb(s) - axis.xa(s) >= 4]
        if not xs:
            return []
        d = "".join(f"M{x} {bar_y}v{_BAR_H}" for x in xs)
        return [f'<path class="step-boundaries" d="{d}" stroke="#ffffff" stroke-width="1"/>']

    def _stall(self, mark: StallMark, bar_y: float) -> list[str]:
        axis = self.axis
        x0, x1 = axis.xb(mark.from_step), axis.xb(mark.to_step)
        w = max(_r(x1 - x0), 2.0)
        out = [
            f'<rect class="stall" x="{x0}" y="{bar_y - 2}" width="{w}" height="{_BAR_H + 4}" '
            f'fill="{COLOURS["stall"]}" fill-opacity="0.9" data-cause-step="{mark.cause_step}">'
            f"<title>{_a(mark.describe())}</title></rect>"
        ]
        label = _ms(mark.seconds) + (
            f" · step {mark.cause_step}" if mark.cause_step is not None else ""
        )
        if w >= len(label) * 5.6 + 4:
            out.append(
                f'<text x="{_r(x0 + 2)}" y="{bar_y + 8}" font-size="9" fill="#ffffff">'
                f"{_a(label)}</text>"
            )
        if len(self.rows) <= 5 and mark.cause_step is not None:  # one request: show the link
            cx = _r((axis.xa(mark.cause_step) + axis.xb(mark.cause_step)) / 2)
            out.append(
                f'<line x1="{cx}" y1="{self.strip_bottom}" x2="{cx}" y2="{bar_y - 2}" '
                f'stroke="{COLOURS["stall"]}" stroke-dasharray="2,2" stroke-width="1"/>'
            )
        return out


def _buckets(spans: list[StepSpan], axis: _Axis) -> list[list[StepSpan]]:
    """Steps grouped so that each group is at least 2 px wide (one step a group when wide)."""
    groups: list[list[StepSpan]] = []
    group_x = -1.0
    for span in spans:
        x = axis.xa(span.step)
        if groups and x - group_x < 2:
            groups[-1].append(span)
        else:
            groups.append([span])
            group_x = x
    return groups


def _stalled(marks: list[StallMark]) -> str:
    shown = ", ".join(f"{m.request_id} {_ms(m.seconds)}" for m in marks[:4])
    more = f", +{len(marks) - 4} more" if len(marks) > 4 else ""
    return f"{len(marks)} request{'s' * (len(marks) != 1)} ({shown}{more})"


def render_html(
    path: str | Path,
    *,
    first_step: int | None = None,
    last_step: int | None = None,
    request_ids: set[str] | None = None,
    top: int = 25,
    run: int | None = None,
    model: str | None = None,
    time_axis: bool = False,
    stall_s: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """The same timeline in a self-contained HTML page (inline SVG, inline style), headed by
    the model and the config it ran with (in a log several models share: the model's first
    load's)."""
    timeline = collect(path, run=run, model=model, stall_s=stall_s, progress=progress)
    name, config = _run_config(path, run, timeline)
    target = step_time_target(config)
    picture = _Picture(timeline, first_step, last_step, request_ids, top, time_axis, target)
    settings = ", ".join(f"{k}={v}" for k, v in sorted(config.items()))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>stepline replay: {_a(Path(path).name)}</title>\n"
        "<style>body{font-family:system-ui,sans-serif;margin:1em}"
        "div.scroll{overflow:auto;border:1px solid #ddd}</style>\n</head>\n<body>\n"
        f"<h1>{_a(Path(path).name)}</h1>\n"
        f"<p>model {_a(name)} · {_a(settings)}</p>\n"
        f'<div class="scroll">\n{picture.svg(xmlns=False)}</div>\n</body>\n</html>\n'
    )
