"""`stepline replay LOG [options]`: inspect, verify and re-execute a recorded run.

`--serve` opens the dashboard on the log instead (replay_serve.py).

The CLI (api/cli.py) wires it in with `add_replay_parser(subparsers)`; `run_replay(args)`
returns the exit code: 0 fine, 1 violations found (verify), or tokens diverged or nothing
could be compared (reexecute), 2 the log or the arguments cannot be used (message on stderr).

A log several models share (a server of several): the summary and verify go model by model,
`--request` finds its request's model, and the views of steps, states, pictures, traces and
re-execution need `--model NAME`. Several logs, one per engine behind a router: the summary,
`--request` and `--verify` across them (replay_engines.py).

One log's views are a table (`_VIEWS`): the first asked for answers, then the pictures and
the trace asked for are written. Each view's text is replay_text.py's; the exit codes, the
progress line and writing a report are replay_output.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from stepline.api.cli.replay_engines import run_engines
from stepline.api.cli.replay_output import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNUSABLE,
    Progress,
    emit,
    per_run,
)
from stepline.api.cli.replay_serve import add_serve_args, serve_log
from stepline.api.cli.replay_text import (
    each_run,
    text_model_summaries,
    text_model_verify,
    text_reexecute,
    text_state,
    text_steps,
    text_summary,
    text_verify,
)
from stepline.api.reexecute import reexecute
from stepline.events.fold import FoldError
from stepline.events.log import LogCorruptError, TornLineWarning, UnsupportedSchemaError, read_runs
from stepline.events.replay import (
    ModelNeededError,
    RunNeededError,
    UnknownModelError,
    UnknownRequestError,
    UnknownRunError,
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
from stepline.events.replay.request_text import text_timeline
from stepline.events.replay.svg import render_html, render_svg
from stepline.events.replay.trace import DEFAULT_TRACKS, export_trace

__all__ = ["Progress", "add_replay_parser", "parse_step_range", "run_replay"]


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
    add_serve_args(p)
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
    if getattr(args, "serve", False) and len(args.log) > 1:
        print("stepline replay: --serve shows one log", file=sys.stderr)
        return EXIT_UNUSABLE
    if len(args.log) == 1:
        args = argparse.Namespace(**{**vars(args), "log": args.log[0]})
        view = serve_log if getattr(args, "serve", False) else _run
    else:
        view = run_engines
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


@dataclass
class _Ask:
    """What one log's view is asked: the parsed arguments, resolved against the log."""

    args: argparse.Namespace
    run: int | None  # None: every run, each on its own
    model: str | None
    shared: bool  # several models share the log
    first: int | None  # the steps shown (and drawn)
    last: int | None
    progress: Progress


@dataclass
class _Shown:
    """A view's answer: its report, the text of it, the exit code."""

    report: BaseModel
    text: Callable[[Any], list[str]]
    code: int = EXIT_OK


def _reexecuted(ask: _Ask) -> _Shown:
    log = ask.args.log
    name = resolve_model(log, ask.model, run=ask.run, needed=True) if ask.shared else None
    rx = asyncio.run(
        reexecute(
            log,
            model=None if ask.shared else ask.model,
            run=ask.run,
            name=name,
            on_plan=lambda plan: print(
                f"stepline replay: {plan.describe()}", file=sys.stderr, flush=True
            ),
            on_progress=ask.progress.requests,
        )
    )
    code = EXIT_UNUSABLE if rx.cannot_run else (EXIT_OK if rx.ok else EXIT_FAILED)
    return _Shown(rx, text_reexecute, code)


def _timeline(ask: _Ask) -> _Shown:
    timeline = request_timeline(ask.args.log, ask.args.request, run=ask.run, model=ask.model)
    ask.model = ask.model or timeline.model  # its pictures are of its model's steps
    return _Shown(timeline.within(ask.first, ask.last), text_timeline)


def _state(ask: _Ask) -> _Shown:
    def view(run: int) -> BaseModel:
        log, step = ask.args.log, ask.args.at_step
        return state_at_step(log, step, run=run, model=ask.model, progress=ask.progress.events)

    return _Shown(per_run(ask.args.log, ask.run, view), each_run(text_state))


def _steps(ask: _Ask) -> _Shown:
    def view(run: int) -> BaseModel:
        log, first, last = ask.args.log, ask.first, ask.last
        return step_records(
            log, first, last, run=run, model=ask.model, progress=ask.progress.events
        )

    return _Shown(per_run(ask.args.log, ask.run, view), each_run(text_steps))


def _model_verify(ask: _Ask) -> _Shown:
    mv = verify_models(ask.args.log, run=ask.run)
    return _Shown(mv, text_model_verify, EXIT_OK if mv.ok else EXIT_FAILED)


def _verify(ask: _Ask) -> _Shown:
    vr = verify(ask.args.log, run=ask.run, model=ask.model)
    return _Shown(vr, text_verify, EXIT_OK if vr.ok else EXIT_FAILED)


def _model_summaries(ask: _Ask) -> _Shown:
    report = summarize_models(ask.args.log, run=ask.run, progress=ask.progress.events)
    return _Shown(report, text_model_summaries)


def _summary(ask: _Ask) -> _Shown:
    report = summarize(ask.args.log, run=ask.run, model=ask.model, progress=ask.progress.events)
    return _Shown(report, text_summary)


def _summary_asked(ask: _Ask) -> bool:
    """The summary is the default: asked for, or no picture or trace instead."""
    a = ask.args
    return bool(a.summary or not (a.svg or a.html or a.trace))


def _each_model(ask: _Ask) -> bool:
    return ask.shared and ask.model is None


# One log's views, the first that is asked for answers: (asked?, the view).
_VIEWS: tuple[tuple[Callable[[_Ask], bool], Callable[[_Ask], _Shown]], ...] = (
    (lambda ask: bool(ask.args.reexecute), _reexecuted),
    (lambda ask: bool(ask.args.request), _timeline),
    (lambda ask: ask.args.at_step is not None, _state),
    (lambda ask: bool(ask.args.steps), _steps),
    (lambda ask: bool(ask.args.verify) and _each_model(ask), _model_verify),
    (lambda ask: bool(ask.args.verify), _verify),
    (lambda ask: _summary_asked(ask) and _each_model(ask), _model_summaries),
    (_summary_asked, _summary),
)


def _run(args: argparse.Namespace, out: TextIO) -> int:
    """`stepline replay` of one log: its view (the table's first asked), then its pictures
    and trace, then the view's report."""
    ask = _ask(args)
    # The view first: it fails on an unknown request id before any file is written.
    shown = next((view(ask) for asked, view in _VIEWS if asked(ask)), None)
    ask.progress.done()
    _pictures(ask)
    if args.trace:
        _trace(ask)
    if shown is None:
        return EXIT_OK
    emit(shown.report, args.json, out, shown.text)
    return shown.code


def _ask(args: argparse.Namespace) -> _Ask:
    """`args` resolved against the log: its run, its model (an unknown name fails here)."""
    first, last = args.steps if args.steps else (None, None)
    if args.at_step is not None:
        last = args.at_step  # the picture stops where the state is taken
    run = resolve_run(args.log, args.run)
    # A log several models share: `--model` names one of them. In a log of one model it
    # names that one, or with --reexecute what to load in its place.
    shared = any(r.header.models for r in read_runs(args.log) if run in (None, r.index))
    model = args.model
    if model is not None and (shared or not args.reexecute):
        resolve_model(args.log, model, run=run)
    return _Ask(args, run, model, shared, first, last, Progress(sys.stderr, args.log))


def _stall_s(args: argparse.Namespace) -> float | None:
    return args.stall_ms / 1000 if args.stall_ms is not None else None


def _pictures(ask: _Ask) -> None:
    """Write the SVG and HTML pictures asked for."""
    args = ask.args
    for target, render in ((args.svg, render_svg), (args.html, render_html)):
        if target:
            picture = render(
                args.log,
                first_step=ask.first,
                last_step=ask.last,
                request_ids={args.request} if args.request else None,
                top=args.top,
                run=resolve_run(args.log, ask.run, needed=True),
                model=ask.model,
                time_axis=args.time_axis,
                stall_s=_stall_s(args),
                progress=ask.progress.events,
            )
            ask.progress.done()
            target.write_text(picture, encoding="utf-8")
            print(f"wrote {target}", file=sys.stderr)


def _trace(ask: _Ask) -> None:
    """Write the Chrome trace asked for, and say what it holds."""
    args = ask.args
    stats = export_trace(
        args.log,
        args.trace,
        run=resolve_run(args.log, ask.run, needed=True),
        model=ask.model,
        request_ids={args.request} if args.request else None,
        stall_s=_stall_s(args),
        tracks=args.trace_tracks,
        progress=ask.progress.events,
    )
    ask.progress.done()
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
