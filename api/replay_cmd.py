"""`stepline replay LOG [options]`: inspect, verify and re-execute a recorded run.

The CLI (api/cli.py) wires it in with `add_replay_parser(subparsers)`; `run_replay(args)`
returns the exit code: 0 fine, 1 violations found (verify) or tokens diverged (reexecute),
2 the log or the arguments cannot be used (message on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import warnings
from pathlib import Path
from typing import TextIO

from pydantic import BaseModel

from stepline.events.fold import FoldError
from stepline.events.log import LogCorruptError, TornLineWarning, UnsupportedSchemaError
from stepline.events.models import EVENT_ADAPTER
from stepline.events.reexecute import ReexecuteReport, reexecute
from stepline.events.replay import (
    InFlight,
    Percentiles,
    RequestTimeline,
    StateAtStep,
    StepsReport,
    Summary,
    UnknownRequestError,
    VerifyReport,
    describe_event,
    describe_status,
    request_timeline,
    state_at_step,
    step_records,
    summarize,
    verify,
)
from stepline.events.timeline_svg import render_html, render_svg

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
    p.add_argument("log", type=Path, help="the log (its first file, for a rotated set)")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--request", metavar="ID", help="the timeline of one request")
    view.add_argument("--at-step", type=int, metavar="N", help="every request's state at step N")
    view.add_argument(
        "--steps", type=parse_step_range, metavar="A..B", help="per step: members, tokens, budget"
    )
    view.add_argument("--summary", action="store_true", help="the summary (the default view)")
    view.add_argument("--verify", action="store_true", help="check the engine's invariants")
    view.add_argument(
        "--reexecute", action="store_true", help="run the requests again and compare tokens"
    )
    p.add_argument("--model", help="with --reexecute: the model to use (default: the log's)")
    p.add_argument("--svg", type=Path, metavar="FILE", help="write a timeline picture (SVG)")
    p.add_argument("--html", type=Path, metavar="FILE", help="write a timeline picture (HTML)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_replay)
    return p


def run_replay(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """Run `stepline replay` with parsed `args`; returns the exit code."""
    out = out or sys.stdout
    if args.model and not args.reexecute:
        print("stepline replay: --model only goes with --reexecute", file=sys.stderr)
        return EXIT_UNUSABLE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TornLineWarning)
        try:
            code = _run(args, out)
        except (
            FileNotFoundError,
            LogCorruptError,
            UnsupportedSchemaError,
            UnknownRequestError,
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


def _run(args: argparse.Namespace, out: TextIO) -> int:
    first, last = args.steps if args.steps else (None, None)
    if args.at_step is not None:
        last = args.at_step  # the picture stops where the state is taken
    request_ids = {args.request} if args.request else None

    # The view first: it fails on an unknown request id before any file is written.
    report: BaseModel | None = None
    code = EXIT_OK
    if args.reexecute:
        rx = asyncio.run(reexecute(args.log, model=args.model))
        report, text = rx, _text_reexecute
        code = EXIT_UNUSABLE if rx.cannot_run else (EXIT_OK if rx.ok else EXIT_FAILED)
    elif args.request:
        report, text = request_timeline(args.log, args.request), _text_timeline
    elif args.at_step is not None:
        report, text = state_at_step(args.log, args.at_step), _text_state
    elif args.steps:
        report, text = step_records(args.log, first, last), _text_steps
    elif args.verify:
        vr = verify(args.log)
        report, text = vr, _text_verify
        code = EXIT_OK if vr.ok else EXIT_FAILED
    elif args.summary or not (args.svg or args.html):
        report, text = summarize(args.log), _text_summary

    for target, render in ((args.svg, render_svg), (args.html, render_html)):
        if target:
            picture = render(args.log, first_step=first, last_step=last, request_ids=request_ids)
            target.write_text(picture, encoding="utf-8")
            print(f"wrote {target}", file=sys.stderr)
    if report is not None:
        _emit(report, args.json, out, text)
    return code


def _emit(report: BaseModel, as_json: bool, out: TextIO, text) -> None:
    if as_json:
        out.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.write("\n".join(text(report)) + "\n")


# ---------------------------------------------------------------------------------------------
# Text views.


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds:.3f} s"


def _names(ids: tuple[str, ...], limit: int = 5) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f", +{len(ids) - limit} more" if len(ids) > limit else "")


def _text_timeline(t: RequestTimeline) -> list[str]:
    cached = f", {t.num_cached_tokens} cached ({t.cache_source})" if t.num_cached_tokens else ""
    end = (
        f"{t.terminal.reason.value}" + (f" ({t.terminal.message})" if t.terminal.message else "")
        if t.terminal
        else "no terminal event (in flight when the log ends)"
    )
    lines = [
        f"request {t.request_id}: {t.num_prompt_tokens} prompt tokens{cached}, "
        f"{t.num_output_tokens} output tokens, {end}",
        f"  queueing {_s(t.queueing_s)}  TTFT {_s(t.ttft_s)}  ITL p50 {_s(t.itl.p50)} "
        f"p99 {_s(t.itl.p99)} max {_s(t.itl.max)}  end-to-end {_s(t.e2e_s)}",
        f"  {'step':>6}  {'t':>10}  event",
        f"  {t.admitted_step:>6}  {_s(0.0):>10}  admitted (seq {t.admitted_seq})",
    ]
    shares = {s.step: s for s in t.steps}
    rows: list[tuple[int, int, float, str]] = []  # (seq, step, ts, what)
    for c in t.chunks:
        rows.append((c.seq, c.step, c.ts, f"prefill [{c.start}, {c.end})"))
    for cp in t.checkpoints_reached:
        rows.append((cp.seq, cp.step, cp.ts, f"checkpoint at {cp.offset}"))
    for i, tok in enumerate(t.tokens):
        label = "first token" if i == 0 else "token"
        rows.append((tok.seq, tok.step, tok.ts, f"{label} {list(tok.token_ids)}"))
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


def _text_state(s: StateAtStep) -> list[str]:
    counts = ", ".join(f"{n} {k}" for k, n in s.counts.items()) or "no requests"
    lines = [f"state at step {s.step}: {counts}"]
    width = max((len(r.request_id) for r in s.requests), default=8)
    for r in s.requests:
        lines.append(f"  {r.request_id:<{width}}  {r.description}")
    return lines


def _text_steps(report: StepsReport) -> list[str]:
    if not report.steps:
        return ["no steps in that range"]
    lines = []
    for st in report.steps:
        lines.append(
            f"step {st.step}: {st.num_tokens}/{st.max_step_tokens} tokens "
            f"({st.utilisation:.0%}), {st.num_seqs}/{st.max_num_seqs} requests, "
            f"took {_s(st.duration_s)}"
        )
        for m in st.members:
            rng = f" [{m.prompt_range[0]}, {m.prompt_range[1]})" if m.prompt_range else ""
            lines.append(f"  {m.request_id:<20} {m.kind:<7} {m.num_tokens:>6}{rng}")
        if st.finished:
            lines.append(f"  finished: {_names(st.finished, 10)}")
    return lines


def _row(name: str, p: Percentiles) -> str:
    if not p.count:
        return f"  {name:<16}{'-':>8}"
    return (
        f"  {name:<16}{p.count:>8}  {_s(p.mean):>10}  {_s(p.p50):>10}  {_s(p.p90):>10}  "
        f"{_s(p.p99):>10}  {_s(p.max):>10}"
    )


def _text_summary(s: Summary) -> list[str]:
    h = s.header
    config = ", ".join(f"{k}={v}" for k, v in sorted(h.config.items()))
    outcomes = ", ".join(f"{n} {k}" for k, n in s.outcomes.items()) or "none"
    steps = f"steps {s.first_step}..{s.last_step}" if s.num_steps else "no steps"
    u = s.budget_utilisation
    lines = [
        f"log {s.files[0]} ({len(s.files)} file{'s' * (len(s.files) != 1)}), "
        f"schema {h.schema_version}, model {h.model}, prompts logged: {h.log_prompts}",
        f"config: {config or '-'}",
        f"{s.num_events} events, {s.num_steps} {steps}, over {_s(s.duration_s)}",
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
            lines.append(
                f"  {st.request_id}: {_s(st.seconds)} from step {st.from_step} to {st.to_step}"
            )
    if s.slowest_steps:
        lines.append("slowest steps:")
        for st in s.slowest_steps:
            lines.append(
                f"  step {st.step}: {_s(st.seconds)}, {st.num_tokens} tokens, "
                f"{st.num_seqs} request{'s' * (st.num_seqs != 1)}"
            )
    if s.in_flight:
        lines.append(f"in flight when the log ends ({len(s.in_flight)}; a crashed run?):")
        lines.extend(_in_flight_lines(s.in_flight))
    return lines


def _in_flight_lines(in_flight: tuple[InFlight, ...]) -> list[str]:
    return [
        f"  {r.request_id}: "
        + describe_status(r.status, r.num_computed_tokens, r.num_prompt_tokens, r.num_output_tokens)
        + f" (admitted step {r.admitted_step})"
        for r in in_flight
    ]


def _text_verify(v: VerifyReport) -> list[str]:
    lines = [
        f"verify {v.files[0] if v.files else '?'}: {v.num_events} events, "
        f"{v.num_requests} requests, {v.num_steps} steps"
    ]
    if v.ok:
        lines.append("OK: no violations")
    else:
        total = sum(v.counts.values())
        by_kind = ", ".join(f"{n} {k}" for k, n in v.counts.items())
        lines.append(f"FAILED: {total} violation{'s' * (total != 1)} ({by_kind})")
        for viol in v.violations:
            lines.append(f"  {viol.kind.value}: {viol.message}")
            for e in viol.events:
                lines.append(f"      {_describe_dict(e)}")
        shown = len(v.violations)
        if shown < total:
            lines.append(f"  ... {total - shown} more not shown (use --json for the counts)")
    if v.in_flight:
        lines.append(
            f"in flight when the log ends ({len(v.in_flight)}; the log ends early, "
            "not a violation):"
        )
        lines.extend(_in_flight_lines(v.in_flight))
    return lines


def _describe_dict(raw: dict) -> str:
    return describe_event(EVENT_ADAPTER.validate_python(raw))


def _text_reexecute(report: ReexecuteReport) -> list[str]:
    return report.describe()
