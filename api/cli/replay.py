"""`stepline replay LOG [options]`: inspect, verify and re-execute a recorded run.

The CLI (api/cli.py) wires it in with `add_replay_parser(subparsers)`; `run_replay(args)`
returns the exit code: 0 fine, 1 violations found (verify), or tokens diverged or nothing
could be compared (reexecute), 2 the log or the arguments cannot be used (message on stderr).

A log several models share (a server of several): the summary and verify go model by model,
`--request` finds its request's model, and the views of steps, states, pictures, traces and
re-execution need `--model NAME`. Several logs, one per engine behind a router: the summary,
`--request` and `--verify` across them (replay_engines.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from stepline.api.reexecute import reexecute
from stepline.events.fold import FoldError
from stepline.events.log import (
    LogCorruptError,
    TornLineWarning,
    UnsupportedSchemaError,
    log_files,
    read_runs,
)
from stepline.events.models import EVENT_ADAPTER, Decoding
from stepline.events.replay import (
    InFlight,
    ModelLoads,
    ModelNeededError,
    ModelSummaries,
    ModelVerifyReports,
    Percentiles,
    RequestTimeline,
    RunNeededError,
    SlowStep,
    StateAtStep,
    StepsReport,
    Summary,
    UnknownModelError,
    UnknownRequestError,
    UnknownRunError,
    VerifyReport,
    describe_event,
    describe_status,
    describe_tokens,
    request_timeline,
    resolve_model,
    resolve_run,
    state_at_step,
    step_records,
    summarize,
    summarize_models,
    verify,
    verify_models,
)
from stepline.events.replay.describe import describe_bytes
from stepline.events.replay.reexecute import ReexecuteReport
from stepline.events.replay.svg import render_html, render_svg
from stepline.events.replay.timeline import format_ms
from stepline.events.replay.trace import DEFAULT_TRACKS, export_trace
from stepline.events.replay.why import RequestWhy

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


def parse_step_range(text: str) -> tuple[int | None, int | None]:
    """'A..B', 'A..', '..B' or 'N' -> (first, last), inclusive."""
    try:
        if ".." not in text:
            return int(text), int(text)
        a, b = text.split("..", 1)
        first, last = (int(a) if a else None), (int(b) if b else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step range: write A..B, A.., ..B or N"
        ) from None
    if first is not None and last is not None and last < first:
        raise argparse.ArgumentTypeError(f"step range {text!r} ends before it starts")
    return first, last


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def add_replay_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `replay` sub-command to `subparsers`; it sets `func=run_replay`."""
    p = subparsers.add_parser(
        "replay",
        help="inspect, verify and re-execute an event log",
        description=(
            "Answer questions about a recorded run from its event log. With no view option, "
            "prints a summary. Exit code 1 when --verify finds violations or --reexecute "
            "diverges, 2 when the log cannot be read."
        ),
    )
    p.add_argument(
        "log",
        type=Path,
        nargs="+",
        help="the log (its first file, for a rotated set); several logs, one per engine behind "
        "a router: the summary, --request and --verify across them",
    )
    p.add_argument(
        "--request",
        metavar="ID",
        help="the timeline of one request (with --steps A..B, of those steps); a picture "
        "(--svg, --html) zooms to its life",
    )
    view = p.add_mutually_exclusive_group()
    view.add_argument("--at-step", type=int, metavar="N", help="every request's state at step N")
    view.add_argument(
        "--steps", type=parse_step_range, metavar="A..B", help="per step: members, tokens, budget"
    )
    view.add_argument("--summary", action="store_true", help="the summary (the default view)")
    view.add_argument("--verify", action="store_true", help="check the engine's invariants")
    view.add_argument(
        "--reexecute",
        action="store_true",
        help="run the requests again and compare tokens (only greedy or seeded requests can be "
        "compared; exit 1 if none was)",
    )
    p.add_argument(
        "--run",
        metavar="N|ID",
        help="one run of a log that holds several (restarts append runs): its number (1 = the "
        "first) or its run id; default: every run, each on its own",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="one model of a log several models share (a server of several): every view "
        "looks at its events alone; the views of steps, states, pictures, traces and "
        "--reexecute need it there. In a log of one model, with --reexecute: the model to "
        "load instead of the log's",
    )
    p.add_argument("--svg", type=Path, metavar="FILE", help="write a timeline picture (SVG)")
    p.add_argument("--html", type=Path, metavar="FILE", help="write a timeline picture (HTML)")
    p.add_argument(
        "--time-axis",
        action="store_true",
        help="lay the picture's steps out by time (measured step times; idle gaps show)",
    )
    p.add_argument(
        "--top",
        type=_positive_int,
        default=25,
        metavar="N",
        help="a picture of more requests draws the N that waited longest for a token and "
        "folds the rest (default 25)",
    )
    p.add_argument(
        "--stall-ms",
        type=float,
        metavar="MS",
        help="a gap between two tokens longer than this is a stall (pictures and --trace; "
        "default: three times the run's median gap)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="write the run as Chrome Trace Event JSON (open it in ui.perfetto.dev or "
        "chrome://tracing); with --request, that request alone",
    )
    p.add_argument(
        "--trace-tracks",
        type=_positive_int,
        default=DEFAULT_TRACKS,
        metavar="N",
        help="a trace packs requests onto at most N tracks; past N in flight at once, those "
        "that waited longest for a token are drawn and the rest counted "
        f"(default {DEFAULT_TRACKS})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_replay)
    return p


def run_replay(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """Run `stepline replay` with parsed `args`; returns the exit code."""
    out = out or sys.stdout
    if args.request and (args.at_step is not None or args.summary or args.verify or args.reexecute):
        print(
            "stepline replay: --request goes with --steps (and pictures), not with "
            "--at-step, --summary, --verify or --reexecute",
            file=sys.stderr,
        )
        return EXIT_UNUSABLE
    if len(args.log) == 1:
        args, view = argparse.Namespace(**{**vars(args), "log": args.log[0]}), _run
    else:
        view = _run_engines
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TornLineWarning)
        try:
            code = view(args, out)
        except (
            FileNotFoundError,
            LogCorruptError,
            UnsupportedSchemaError,
            UnknownRequestError,
            UnknownRunError,
            RunNeededError,
            UnknownModelError,
            ModelNeededError,
        ) as exc:
            print(f"stepline replay: {exc}", file=sys.stderr)
            code = EXIT_UNUSABLE
        except FoldError as exc:
            print(
                f"stepline replay: the log cannot be folded: {exc}; run --verify to see "
                "every violation",
                file=sys.stderr,
            )
            code = EXIT_FAILED
    for w in caught:
        if issubclass(w.category, TornLineWarning):
            print(f"stepline replay: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return code


def _run_engines(args: argparse.Namespace, out: TextIO) -> int:
    from stepline.api.cli.replay_engines import run_engines  # it imports this module

    return run_engines(args, out)


def _run(args: argparse.Namespace, out: TextIO) -> int:
    first, last = args.steps if args.steps else (None, None)
    if args.at_step is not None:
        last = args.at_step  # the picture stops where the state is taken
    request_ids = {args.request} if args.request else None
    run = resolve_run(args.log, args.run)
    stall_s = args.stall_ms / 1000 if args.stall_ms is not None else None
    progress = Progress(sys.stderr, args.log)
    # A log several models share: `--model` names one of them. In a log of one model it
    # names that one, or with --reexecute what to load in its place.
    shared = any(r.header.models for r in read_runs(args.log) if run in (None, r.index))
    model = args.model
    if model is not None and (shared or not args.reexecute):
        resolve_model(args.log, model, run=run)  # an unknown name fails here

    # The view first: it fails on an unknown request id before any file is written.
    report: BaseModel | None = None
    text: Callable[[Any], list[str]] = _text_summary
    code = EXIT_OK
    if args.reexecute:
        name = resolve_model(args.log, model, run=run, needed=True) if shared else None
        rx = asyncio.run(
            reexecute(
                args.log,
                model=None if shared else model,
                run=run,
                name=name,
                on_plan=lambda plan: print(
                    f"stepline replay: {plan.describe()}", file=sys.stderr, flush=True
                ),
                on_progress=progress.requests,
            )
        )
        progress.done()
        report, text = rx, _text_reexecute
        code = EXIT_UNUSABLE if rx.cannot_run else (EXIT_OK if rx.ok else EXIT_FAILED)
    elif args.request:
        timeline = request_timeline(args.log, args.request, run=run, model=model)
        report, text = timeline.within(first, last), _text_timeline
        model = model or timeline.model  # its pictures are of its model's steps
    elif args.at_step is not None:
        report = _per_run(
            args.log,
            run,
            lambda r: state_at_step(
                args.log, args.at_step, run=r, model=model, progress=progress.events
            ),
        )
        text = _each(_text_state)
        progress.done()
    elif args.steps:
        report = _per_run(
            args.log,
            run,
            lambda r: step_records(
                args.log, first, last, run=r, model=model, progress=progress.events
            ),
        )
        text = _each(_text_steps)
        progress.done()
    elif args.verify and shared and model is None:
        mv = verify_models(args.log, run=run)
        report, text = mv, _text_model_verify
        code = EXIT_OK if mv.ok else EXIT_FAILED
    elif args.verify:
        vr = verify(args.log, run=run, model=model)
        report, text = vr, _text_verify
        code = EXIT_OK if vr.ok else EXIT_FAILED
    elif (args.summary or not (args.svg or args.html or args.trace)) and shared and model is None:
        report = summarize_models(args.log, run=run, progress=progress.events)
        text = _text_model_summaries
        progress.done()
    elif args.summary or not (args.svg or args.html or args.trace):
        report = summarize(args.log, run=run, model=model, progress=progress.events)
        text = _text_summary
        progress.done()

    for target, render in ((args.svg, render_svg), (args.html, render_html)):
        if target:
            picture = render(
                args.log,
                first_step=first,
                last_step=last,
                request_ids=request_ids,
                top=args.top,
                run=resolve_run(args.log, run, needed=True),
                model=model,
                time_axis=args.time_axis,
                stall_s=stall_s,
                progress=progress.events,
            )
            progress.done()
            target.write_text(picture, encoding="utf-8")
            print(f"wrote {target}", file=sys.stderr)
    if args.trace:
        stats = export_trace(
            args.log,
            args.trace,
            run=resolve_run(args.log, run, needed=True),
            model=model,
            request_ids=request_ids,
            stall_s=stall_s,
            tracks=args.trace_tracks,
            progress=progress.events,
        )
        progress.done()
        not_drawn = (
            f" ({stats.num_requests_not_drawn} not drawn: in flight while all "
            f"{stats.num_tracks} tracks were taken; --trace-tracks N draws more, --request ID "
            "one)"
            if stats.num_requests_not_drawn
            else ""
        )
        print(
            f"wrote {args.trace}: {stats.num_steps} steps, {stats.num_requests} requests on "
            f"{stats.num_tracks} tracks{not_drawn}, {stats.num_stalls} stalls over "
            f"{stats.stall_threshold_s * 1000:.1f} ms (open it in ui.perfetto.dev or "
            "chrome://tracing)",
            file=sys.stderr,
        )
    if report is not None:
        _emit(report, args.json, out, text)
    return code


class Progress:
    """Progress of a long replay on a terminal: one line on stderr, rewritten in place, and
    cleared when done. Silent when the stream is not a terminal (a pipe, a file, a test)."""

    def __init__(self, stream: TextIO, log: Path) -> None:
        self.stream = stream if stream.isatty() else None
        self.log = log
        self.shown = False
        self._estimate: int | None = None

    def events(self, num_events: int) -> None:
        """`num_events` read so far; the total is estimated from the log's size."""
        if self.stream is None:
            return
        if self._estimate is None:
            self._estimate = _estimated_events(self.log)
        share = min(99, 100 * num_events // max(self._estimate, 1))
        self._show(f"reading {self.log.name}: {num_events:,} events (~{share}%)")

    def requests(self, done: int, total: int) -> None:
        """`done` of `total` requests re-executed."""
        if self.stream is not None:
            self._show(f"re-executed {done} of {total} requests")

    def _show(self, line: str) -> None:
        assert self.stream is not None
        self.stream.write(f"\r\x1b[K{line}")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.stream is not None and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _estimated_events(log: Path) -> int:
    """About how many events the log set holds: its bytes over the mean line of its start."""
    files = log_files(log)
    total = sum(f.stat().st_size for f in files)
    with open(files[0], "rb") as f:
        sample = f.read(1 << 16)
    lines = max(1, sample.count(b"\n"))
    return max(1, total * lines // max(1, len(sample)))


class RunReports(BaseModel):
    """One view, run by run, for a log of several runs."""

    runs: tuple[BaseModel, ...]


def _per_run(path: Path, run: int | None, view: Callable[[int], BaseModel]) -> BaseModel:
    """The view of `run`; of the only run; or, for a log of several, of each run apart."""
    if run is not None:
        return view(run)
    runs = read_runs(path)
    if len(runs) == 1:
        return view(1)
    return RunReports(runs=tuple(view(r.index) for r in runs))


def _each(text: Callable[[Any], list[str]]) -> Callable[[BaseModel], list[str]]:
    def render(report: BaseModel) -> list[str]:
        if not isinstance(report, RunReports):
            return text(report)
        lines: list[str] = []
        for one in report.runs:
            lines.append(f"== run {getattr(one, 'run', '?')} ==")
            lines.extend(text(one))
        return lines

    return render


def _emit(report: BaseModel, as_json: bool, out: TextIO, text) -> None:
    if as_json:
        out.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.write("\n".join(text(report)) + "\n")


# ---------------------------------------------------------------------------------------------
# Text views.


def _s(seconds: float | None) -> str:
    return format_ms(seconds, decimals=3)


def _names(ids: tuple[str, ...], limit: int = 5) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f", +{len(ids) - limit} more" if len(ids) > limit else "")


def _text_timeline(t: RequestTimeline) -> list[str]:
    cached = f", {t.num_cached_tokens} cached ({t.cache_source})" if t.num_cached_tokens else ""
    if t.terminal:
        end = t.terminal.reason.value + (f" ({t.terminal.message})" if t.terminal.message else "")
    elif t.interrupted:
        end = f"interrupted (run {t.run} ended without ending it: the engine stopped)"
    else:
        end = "no terminal event (in flight when the log ends)"
    served = f" (model {t.model})" if t.model is not None else ""
    lines = [
        f"request {t.request_id}{served}: {t.num_prompt_tokens} prompt tokens{cached}, "
        f"{t.num_output_tokens} output tokens, {end}",
        f"  queueing {_s(t.queueing_s)}  TTFT {_s(t.ttft_s)}  ITL p50 {_s(t.itl.p50)} "
        f"p99 {_s(t.itl.p99)} max {_s(t.itl.max)}  end-to-end {_s(t.e2e_s)}",
        *(
            []
            if t.outputs_logged
            else ["  output token ids were not logged (log_outputs=False): only their counts"]
        ),
        *(_text_why(t.why) if t.why is not None else []),
        f"  {'step':>6}  {'t':>10}  event",
    ]
    if t.first_step is not None or t.last_step is not None:
        a = "" if t.first_step is None else t.first_step
        b = "" if t.last_step is None else t.last_step
        lines.insert(-1, f"  steps {a}..{b} only")
    if t.first_step is None or t.admitted_step >= t.first_step:
        lines.append(f"  {t.admitted_step:>6}  {_s(0.0):>10}  admitted (seq {t.admitted_seq})")
    shares = {s.step: s for s in t.steps}
    rows: list[tuple[int, int, float, str]] = []  # (seq, step, ts, what)
    for c in t.chunks:
        rows.append((c.seq, c.step, c.ts, f"prefill [{c.start}, {c.end})"))
    for cp in t.checkpoints_reached:
        rows.append((cp.seq, cp.step, cp.ts, f"checkpoint at {cp.offset}"))
    for i, tok in enumerate(t.tokens):
        label = "first token" if i == 0 else "token"
        rows.append(
            (tok.seq, tok.step, tok.ts, f"{label} {describe_tokens(tok.token_ids, tok.num_tokens)}")
        )
    if t.terminal:
        rows.append((t.terminal.seq, t.terminal.step, t.terminal.ts, f"terminal: {end}"))
    seen_steps: set[int] = set()
    for _, step, ts, what in sorted(rows):
        share = shares.get(step)
        context = ""
        if share is not None and step not in seen_steps:
            seen_steps.add(step)
            others = f"with {_names(share.others)}" if share.others else "alone"
            context = f"   [step: {share.step_tokens}/{share.max_step_tokens} tokens, {others}]"
        lines.append(f"  {step:>6}  {_s(ts - t.admitted_ts):>10}  {what}{context}")
    return lines


def _why_lines(s: Summary) -> list[str]:
    """Stalls by cause, steps against the target, chunk limits and held requests."""
    lines = []
    if s.stall_causes:
        lines.append(
            f"stalls (waits over {_s(s.stall_threshold_s)}) by the request that caused them:"
        )
        for c in s.stall_causes:
            who = c.request_id or "steps with no prompt work"
            lines.append(
                f"  {who}: {_plural(c.num_stalls, 'stall')}, {_s(c.seconds)} in total, in "
                f"{_plural(c.num_steps, 'step')} (worst: step {c.worst_step}, {_s(c.worst_s)})"
            )
    t = s.step_time
    if t is not None and t.target_s is not None:
        ratio = t.over_prediction
        predicted = (
            f"; measured/predicted p50 {ratio.p50:.2f}, p90 {ratio.p90:.2f}, max {ratio.max:.2f}"
            if ratio.count
            else ""
        )
        lines.append(
            f"step time: {t.num_over} of {t.num_decode_steps} decode steps over the "
            f"{_s(t.target_s)} target (worst: step {t.worst_step}, {_s(t.worst_s)}){predicted}"
        )
    if t is not None and (t.num_warming_up or t.cpu_share.count or t.load_avg.count):
        host = []
        if t.num_warming_up:
            host.append(f"{t.num_warming_up} steps while warming up")
        if t.cpu_share.count:
            host.append(f"CPU {t.cpu_share.p50:.2f} cores p50, {t.cpu_share.max:.2f} max")
        if t.load_avg.count:
            host.append(f"load average {t.load_avg.p50:.2f} p50, {t.load_avg.max:.2f} max")
        lines.append("host: " + "; ".join(host))
    if s.chunk_limits:
        bound = ", ".join(f"{k} {n}" for k, n in s.chunk_limits.items())
        lines.append(f"prompt chunks sized by: {bound}")
    if s.held_reasons:
        held = ", ".join(f"{k} {n}" for k, n in s.held_reasons.items())
        lines.append(f"requests sat steps out for: {held}")
    d = s.drafts
    if d is not None:
        lines.append(
            f"drafts: {d.num_proposed} proposed in {_plural(d.num_rows, 'decode row')} of "
            f"{_plural(d.num_requests, 'request')}, {d.num_accepted} kept "
            f"({100 * d.acceptance:.0f}%)"
        )
    return lines


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("s" if n != 1 else "")


def _host(st: SlowStep) -> str:
    parts = []
    if st.predicted_s is not None:
        parts.append(f"predicted {_s(st.predicted_s)}")
    if st.warming_up:
        parts.append("warming up")
    if st.cpu_share is not None:
        parts.append(f"CPU {st.cpu_share:.2f} cores")
    if st.load_avg is not None:
        parts.append(f"load {st.load_avg:.2f}")
    return f" ({', '.join(parts)})" if parts else ""


def _text_why(w: RequestWhy) -> list[str]:
    """Where the request's time went: queued, its prefill and what bound it, its stalls."""
    held = ", ".join(f"{reason} {n}" for reason, n in w.held.items())
    queued = (
        f"  queued {_s(w.queued_s)} ({w.num_steps_waiting} steps ran before its first"
        + (f"; it sat out steps for: {held}" if held else "")
        + ")"
    )
    lines = [queued, f"  {w.summary_line()}"]
    if (drafts := w.drafts_line()) is not None:
        lines.append(f"  {drafts}")
    if w.num_suffered:
        causes = "; ".join(
            f"{_times(c.num_stalls)} by "
            + (f"{c.cause}'s prompt" if c.cause else "steps with no prompt work")
            + f" ({_s(c.seconds)}; worst: step {c.worst_step}, {_s(c.worst_s)})"
            for c in w.suffered
        )
        lines.append(
            f"  stalled {_times(w.num_suffered)} (waits over {_s(w.stall_threshold_s)}), "
            f"{_s(w.suffered_s)} in total: {causes}"
        )
    if w.caused is not None:
        c = w.caused
        lines.append(
            f"  its prompt stalled other requests' streams {_times(c.num_stalls)}, "
            f"{_s(c.seconds)} in total over those streams, in {_plural(c.num_steps, 'step')} "
            f"(worst: step {c.worst_step}, {_s(c.worst_s)})"
        )
    return lines


def _text_state(s: StateAtStep) -> list[str]:
    counts = ", ".join(f"{n} {k}" for k, n in s.counts.items()) or "no requests"
    of = f" of model {s.model}" if s.model is not None else ""
    lines = [f"state at step {s.step}{of}: {counts}"]
    if s.past_end:
        lines[0] = (
            f"step {s.step} is past the end of the log (its last step is {s.last_step}); "
            f"the state when the log ends: {counts}"
        )
    width = max((len(r.request_id) for r in s.requests), default=8)
    for r in s.requests:
        lines.append(f"  {r.request_id:<{width}}  {r.description}")
    return lines


def _text_steps(report: StepsReport) -> list[str]:
    if not report.steps:
        last = report.last_step
        return [
            "no steps in that range"
            + (f" (the log's last step is {last})" if last is not None else " (no steps at all)")
        ]
    lines = []
    if report.steps[0].duration_estimated:
        lines.append(
            "(this log does not record step times: a step's time is estimated as the time "
            "until the next step was planned, idle time included)"
        )
    for st in report.steps:
        took = _s(st.duration_s) + (" (estimated)" if st.duration_estimated else "")
        predicted = f", predicted {_s(st.predicted_s)}" if st.predicted_s is not None else ""
        lines.append(
            f"step {st.step}: {st.num_tokens}/{st.max_step_tokens} tokens "
            f"({st.utilisation:.0%}), {st.num_seqs}/{st.max_num_seqs} requests, "
            f"took {took}{predicted}"
        )
        for m in st.members:
            rng = f" [{m.prompt_range[0]}, {m.prompt_range[1]})" if m.prompt_range else ""
            lines.append(f"  {m.request_id:<20} {m.kind:<7} {m.num_tokens:>6}{rng}")
        if st.finished:
            lines.append(f"  finished: {_names(st.finished, 10)}")
        if st.idle_after_s is not None and st.idle_after_s >= _IDLE_SHOWN_S:
            lines.append(f"  idle {_s(st.idle_after_s)}")
    return lines


_IDLE_SHOWN_S = 0.05  # idle gaps shorter than this are the loop's own bookkeeping


def _row(name: str, p: Percentiles) -> str:
    if not p.count:
        return f"  {name:<16}{'-':>8}"
    return (
        f"  {name:<16}{p.count:>8}  {_s(p.mean):>10}  {_s(p.p50):>10}  {_s(p.p90):>10}  "
        f"{_s(p.p99):>10}  {_s(p.max):>10}"
    )


def _text_model_summaries(ms: ModelSummaries) -> list[str]:
    heading = (f"log {ms.files[0]}: ", ", each on its own (--model NAME for one)")
    return _model_by_model(heading, ms.models, _text_summary)


def _model_by_model(heading: tuple[str, str], reports: Sequence[Any], text: Callable) -> list[str]:
    """A line naming the models between `heading`'s two parts, then each model's report as
    `text` writes one, under a line naming it."""
    names = [r.model or "?" for r in reports]
    lines = [f"{heading[0]}{len(names)} models ({', '.join(names)}){heading[1]}"]
    for one in reports:
        lines.append(f"== model {one.model} ==")
        lines.extend(text(one))
    return lines


def _text_summary(s: Summary) -> list[str]:
    h = s.header
    model = h.model
    settings = h.config
    if s.model is not None and h.models:  # one model of a log several share
        path = s.loads.path if s.loads is not None else h.models.get(s.model, {}).get("model")
        model = f"{s.model} ({path})" if path else s.model
        settings = s.loads.config if s.loads is not None else {}
    config = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    outcomes = ", ".join(f"{n} {k}" for k, n in s.outcomes.items()) or "none"
    if len(s.runs) > 1:
        steps = "steps"  # numbered afresh in each run
    else:
        steps = f"steps {s.first_step}..{s.last_step}" if s.num_steps else "no steps"
    u = s.budget_utilisation
    lines = [
        f"log {s.files[0]} ({len(s.files)} file{'s' * (len(s.files) != 1)}), "
        f"schema {h.schema_version}, model {model}, prompts logged: {h.log_prompts}, "
        f"outputs logged: {h.log_outputs}",
        f"config: {config or '-'}",
        *_load_lines(s.loads),
        *_run_lines(s),
        f"{s.num_events} events, {s.num_steps} {steps}, over {_s(s.duration_s)}" + _time_split(s),
        f"requests: {s.num_requests} ({outcomes})",
        f"tokens: {s.num_prompt_tokens} prompt ({s.num_cached_tokens} from the prefix cache, "
        f"{s.num_prefilled_tokens} prefilled), {s.num_output_tokens} output",
        f"  {'':<16}{'count':>8}  {'mean':>10}  {'p50':>10}  {'p90':>10}  {'p99':>10}  {'max':>10}",
        _row("TTFT", s.ttft_s),
        _row("ITL", s.itl_s),
        _row("queueing", s.queueing_s),
        _row("end-to-end", s.e2e_s),
    ]
    if u.count:
        lines.append(
            f"budget utilisation per step: mean {u.mean:.0%}, p50 {u.p50:.0%}, "
            f"p90 {u.p90:.0%}; requests per step: mean {s.seqs_per_step.mean:.1f}, "
            f"max {s.seqs_per_step.max:.0f}"
        )
    if s.longest_stalls:
        lines.append("longest stalls (between two tokens of a request):")
        for st in s.longest_stalls:
            cause = f": {st.cause}" if st.cause else ""
            more = st.num_requests - 1
            others = f" and {more} other request{'s' * (more != 1)}" if more else ""
            lines.append(
                f"  {st.request_id}{others}: {_s(st.seconds)} from step {st.from_step} to "
                f"{st.to_step}{cause}"
            )
    lines += _why_lines(s)
    multi = len(s.runs) > 1
    if s.slowest_steps:
        estimated = any(st.estimated for st in s.slowest_steps)
        lines.append(
            "slowest steps"
            + (
                " (estimated: this log does not record step times, so a step runs until the "
                "next one was planned, idle time included):"
                if estimated
                else " (executor time):"
            )
        )
        for st in s.slowest_steps:
            where = f"run {st.run} " if multi else ""
            lines.append(
                f"  {where}step {st.step}: {_s(st.seconds)}, {st.num_tokens} tokens, "
                f"{st.num_seqs} request{'s' * (st.num_seqs != 1)}" + _host(st)
            )
    if s.longest_idle and s.longest_idle[0].seconds >= _IDLE_SHOWN_S:
        lines.append("longest idle gaps (nothing to run):")
        for gap in s.longest_idle:
            if gap.seconds >= _IDLE_SHOWN_S:
                where = f"run {gap.run} " if multi else ""
                lines.append(f"  {where}after step {gap.after_step}: {_s(gap.seconds)}")
    if s.interrupted:
        lines.append(
            f"interrupted ({len(s.interrupted)}; the engine stopped while they ran, "
            "and a restart began a new run):"
        )
        lines.extend(_in_flight_lines(s.interrupted, multi))
    if s.in_flight:
        lines.append(f"in flight when the log ends ({len(s.in_flight)}; a crashed run?):")
        lines.extend(_in_flight_lines(s.in_flight, multi))
    return lines


def _load_lines(loads: ModelLoads | None) -> list[str]:
    if loads is None:
        return []
    lines = [f"loads: {loads.num_loads}"]
    if loads.num_loads:
        t = loads.load_s
        lines[0] += (
            f", taking {_s(t.mean)} on average (longest {_s(t.max)}); the last: weights "
            f"{_bytes(loads.weights_bytes)}, KV {_bytes(loads.kv_bytes)}, prefix cache "
            f"{_bytes(loads.prefix_cache_bytes)}"
        )
    if loads.unloads:
        reasons = ", ".join(f"{n} {why}" for why, n in loads.unloads.items())
        lines.append(f"unloads: {reasons} ({_bytes(loads.bytes_freed)} freed)")
    if loads.num_load_failures:
        lines.append(f"load failures: {loads.num_load_failures}")
        lines.extend(
            f"  {message}" + (f" ({n} times)" if n > 1 else "")
            for message, n in loads.load_failures.items()
        )
    return lines


def _bytes(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else describe_bytes(num_bytes)


def _run_lines(s: Summary) -> list[str]:
    if len(s.runs) <= 1:
        return []
    lines = [f"{len(s.runs)} runs (the engine was restarted; each run on its own):"]
    for r in s.runs:
        outcomes = ", ".join(f"{n} {k}" for k, n in r.outcomes.items()) or "none"
        lines.append(
            f"  run {r.index} ({r.run_id or 'no id'}), started {_when(r.created)}: "
            f"{r.num_events} events, {r.num_steps} step{'s' * (r.num_steps != 1)}, "
            f"{r.num_requests} request{'s' * (r.num_requests != 1)} ({outcomes})"
        )
    return lines


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _time_split(s: Summary) -> str:
    if s.busy_s is None:
        return " (step times not recorded in this log)"
    return f": {_s(s.busy_s)} running steps, {_s(s.idle_s)} idle between them"


def _in_flight_lines(in_flight: tuple[InFlight, ...], multi: bool = False) -> list[str]:
    return [
        f"  {f'run {r.run} ' if multi else ''}{r.request_id}: "
        + describe_status(r.status, r.num_computed_tokens, r.num_prompt_tokens, r.num_output_tokens)
        + f" (admitted step {r.admitted_step})"
        for r in in_flight
    ]


def _text_model_verify(mv: ModelVerifyReports) -> list[str]:
    file = mv.files[0] if mv.files else "?"
    lines = _model_by_model(
        (f"verify {file}: ", ", each verified on its own"), mv.models, _text_verify
    )
    failed = [v.model or "?" for v in mv.models if not v.ok]
    lines.append(
        f"FAILED: violations in model {', '.join(failed)}"
        if failed
        else "OK: no violations in any model"
    )
    return lines


def _text_verify(v: VerifyReport) -> list[str]:
    multi = len(v.runs) > 1
    of = f" model {v.model} of" if v.model is not None else ""
    lines = [
        f"verify{of} {v.files[0] if v.files else '?'}: {v.num_events} events, "
        f"{v.num_requests} requests, {v.num_steps} steps"
        + (f", {len(v.runs)} runs (each verified on its own)" if multi else "")
    ]
    if v.ok:
        lines.append("OK: no violations")
    else:
        total = sum(v.counts.values())
        by_kind = ", ".join(f"{n} {k}" for k, n in v.counts.items())
        lines.append(f"FAILED: {total} violation{'s' * (total != 1)} ({by_kind})")
        for viol in v.violations:
            where = f"run {viol.run}: " if multi and viol.run is not None else ""
            lines.append(f"  {where}{viol.kind.value}: {viol.message}")
            for e in viol.events:
                lines.append(f"      {_describe_dict(e)}")
        shown = len(v.violations)
        if shown < total:
            lines.append(f"  ... {total - shown} more not shown (use --json for the counts)")
    if v.interrupted:
        lines.append(
            f"interrupted ({len(v.interrupted)}; their run ended without ending them and a "
            "restart followed: not a violation):"
        )
        lines.extend(_in_flight_lines(v.interrupted, multi))
    if v.in_flight:
        lines.append(
            f"in flight when the log ends ({len(v.in_flight)}; the log ends early, "
            "not a violation):"
        )
        lines.extend(_in_flight_lines(v.in_flight, multi))
    return lines


def _describe_dict(raw: dict) -> str:
    # A violation may show one request's part of a step's tokens: a `Decoding`, which is
    # no event of the log's own (not in the union).
    if raw.get("type") == "decoding":
        return describe_event(Decoding.model_validate(raw))
    return describe_event(EVENT_ADAPTER.validate_python(raw))


def _text_reexecute(report: ReexecuteReport) -> list[str]:
    return report.describe()
