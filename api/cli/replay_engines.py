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

from stepline.api.cli.replay_output import EXIT_FAILED, EXIT_OK, EXIT_UNUSABLE, Progress, emit
from stepline.api.cli.replay_text import text_engines, text_request, text_verify_engines
from stepline.events.replay.engines import (
    EngineSummaries,
    OverlappingLogsError,
    find_request,
    summarize_engines,
    verify_engines,
)


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
            report, text = found, text_request
        elif args.verify:
            verified = verify_engines(args.log)
            report, text = verified, text_verify_engines
            code = EXIT_OK if verified.ok else EXIT_FAILED
        else:
            report, text = _summaries(args), text_engines
    except OverlappingLogsError as exc:
        print(f"stepline replay: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    emit(report, args.json, out, text)
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
