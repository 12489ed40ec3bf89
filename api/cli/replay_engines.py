"""`stepline replay LOG1 LOG2 ...`: several engines' logs (engines behind a router), side by side.

The summary (the default), `--request ID` and `--verify` take several logs
(events/replay/engines.py); the views of one engine's steps (`--at-step`, `--steps` without
`--request`, pictures, traces, `--reexecute`) and the options that pick within one log
(`--run`, `--model`) are refused (exit 2): step numbers and runs are each log's own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from stepline.api.cli.replay import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNUSABLE,
    Progress,
    _emit,
    _names,
    _text_model_summaries,
    _text_model_verify,
    _text_summary,
    _text_timeline,
    _text_verify,
)
from stepline.events.replay.engines import (
    EngineRequests,
    EngineSummaries,
    EngineSummary,
    EngineTotals,
    EngineVerifyReports,
    OverlappingLogsError,
    find_request,
    summarize_engines,
    verify_engines,
)
from stepline.events.replay.summary import Summary
from stepline.events.replay.verify import VerifyReport

_IDS_SHOWN = 5  # request ids listed per engine (--json has them all)


def run_engines(args: argparse.Namespace, out: TextIO) -> int:
    """`stepline replay` of several logs (`args.log`, a list): the exit code, as `run_replay`'s.
    Raises what reading a log raises (`run_replay` reports it)."""
    refused = _one_engine_options(args)
    if refused:
        print(
            f"stepline replay: {', '.join(refused)} look{'s' * (len(refused) == 1)} at one "
            "engine's log (steps and runs are each log's own): replay that log alone. Several "
            "logs give the summary, --request ID (with --steps A..B) and --verify",
            file=sys.stderr,
        )
        return EXIT_UNUSABLE
    code = EXIT_OK
    report: BaseModel
    text: Callable[[Any], list[str]]
    try:
        if args.request:
            found = find_request(args.log, args.request)
            if args.steps:
                first, last = args.steps
                found = found.model_copy(
                    update={
                        "found": tuple(
                            f.model_copy(update={"timeline": f.timeline.within(first, last)})
                            for f in found.found
                        )
                    }
                )
            report, text = found, _text_request
        elif args.verify:
            verified = verify_engines(args.log)
            report, text = verified, _text_verify_engines
            code = EXIT_OK if verified.ok else EXIT_FAILED
        else:
            report, text = _summaries(args), _text_engines
    except OverlappingLogsError as exc:
        print(f"stepline replay: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    _emit(report, args.json, out, text)
    return code


def _one_engine_options(args: argparse.Namespace) -> list[str]:
    options = {
        "--at-step": args.at_step is not None,
        "--steps": args.steps is not None and not args.request,
        "--reexecute": args.reexecute,
        "--svg": args.svg is not None,
        "--html": args.html is not None,
        "--trace": args.trace is not None,
        "--run": args.run is not None,
        "--model": args.model is not None,
    }
    return [name for name, given in options.items() if given]


def _summaries(args: argparse.Namespace) -> EngineSummaries:
    shown: list[Progress] = []

    def progress(log: Path) -> Callable[[int], None]:
        if shown:
            shown[-1].done()
        shown.append(Progress(sys.stderr, log))
        return shown[-1].events

    try:
        return summarize_engines(args.log, progress=progress)
    finally:
        if shown:
            shown[-1].done()


# ---------------------------------------------------------------------------------------------
# Text views.


def _text_engines(es: EngineSummaries) -> list[str]:
    """The engines' figures side by side and in all, who served which request, then each
    engine's summary under its name."""
    width = max(len("in all"), *(len(e.engine) for e in es.engines))
    head = ("requests", "finished", "failed", "prompt", "cached", "computed", "output")
    lines = [
        f"{len(es.engines)} engines' logs, side by side (each engine named by its log's file "
        "name):",
        f"  {'engine':<{width}}  " + "  ".join(f"{h:>8}" for h in head) + "  model",
    ]
    for e in es.engines:
        lines.append(_totals_row(e.engine, width, e.totals, ", ".join(e.models) or "-"))
    lines.append(_totals_row("in all", width, es.totals, ""))
    lines.append(
        "  (finished: stop, length; failed: error, rejected; prompt: cached (prefix cache) + "
        "computed)"
    )
    lines.append("requests by engine (--request ID: one request's timeline and engine):")
    for e in es.engines:
        ids = e.request_ids
        lines.append(f"  {e.engine:<{width}}  {len(ids)}: {_names(ids, _IDS_SHOWN) or '-'}")
    several = es.in_several()
    if several:
        lines.append(
            f"in more than one engine's log ({len(several)}; retried?): "
            + _names(tuple(f"{rid} ({', '.join(e)})" for rid, e in several.items()), _IDS_SHOWN)
        )
    for e in es.engines:
        lines.append(f"== engine {e.engine} ==")
        lines.extend(_text_engine_summary(e))
    return lines


def _totals_row(name: str, width: int, t: EngineTotals, model: str) -> str:
    figures = (
        t.num_requests,
        t.num_finished,
        t.num_failed,
        t.num_prompt_tokens,
        t.num_cached_tokens,
        t.num_prefilled_tokens,
        t.num_output_tokens,
    )
    return f"  {name:<{width}}  " + "  ".join(f"{n:>8}" for n in figures) + f"  {model}".rstrip()


def _text_engine_summary(e: EngineSummary) -> list[str]:
    if isinstance(e.summary, Summary):
        return _text_summary(e.summary)
    return _text_model_summaries(e.summary)


def _text_request(er: EngineRequests) -> list[str]:
    where = ", ".join(f"{f.engine} ({f.log})" for f in er.found)
    if len(er.found) == 1:
        lines = [f"request {er.request_id}: served by engine {where}"]
        return lines + _text_timeline(er.found[0].timeline)
    lines = [
        f"request {er.request_id} is in {len(er.found)} engines' logs (a retried request?): "
        + where
    ]
    for f in er.found:
        lines.append(f"== engine {f.engine} ==")
        lines.extend(_text_timeline(f.timeline))
    return lines


def _text_verify_engines(ev: EngineVerifyReports) -> list[str]:
    lines = [f"verify {len(ev.engines)} engines' logs, each on its own:"]
    for e in ev.engines:
        lines.append(f"== engine {e.engine} ==")
        report = e.report
        if isinstance(report, VerifyReport):
            lines.extend(_text_verify(report))
        else:
            lines.extend(_text_model_verify(report))
    failed = [e.engine for e in ev.engines if not e.report.ok]
    lines.append(
        f"FAILED: violations in the log of engine{'s' * (len(failed) > 1)} {', '.join(failed)}"
        if failed
        else "OK: no violations in any engine's log"
    )
    return lines
