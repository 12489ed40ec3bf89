"""Replay of several engines' logs: engines behind a router, each writing its own log.

Each engine's log is read as `stepline replay` reads one (its summary, one request's
timeline, its verification); this module adds what only the set can say: which engine served
which request, and the engines' figures side by side and added up.

An engine is named by its log's file name without the suffix (`engine-a.jsonl`: `engine-a`),
with as many parent folders as it takes to tell two logs apart (`a/run`, `b/run`). A log's
header records the model and the engine config, which engines behind one router share, and
nothing (host, port) that tells them apart; the file name is what the engine's operator chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from stepline.events.log import log_files, read_header, read_runs
from stepline.events.models import FinishReason
from stepline.events.replay.describe import RequestNotInLogError, UnknownRequestError
from stepline.events.replay.stats import Report
from stepline.events.replay.summary import ModelSummaries, Summary, summarize, summarize_models
from stepline.events.replay.verify import ModelVerifyReports, VerifyReport, verify, verify_models
from stepline.events.replay.views import RequestTimeline, request_timeline
from stepline.events.scan import scan_run_events

_FINISHED = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.LOOP)
_FAILED = (FinishReason.ERROR, FinishReason.REJECTED)


class OverlappingLogsError(ValueError):
    """Two of the logs given are one log set (a rotated file passed beside its first file,
    or one log twice): each engine's log goes once, by its first file."""


class EngineTotals(Report):
    """An engine's requests and tokens (or all engines'), added up over its runs and models."""

    num_requests: int
    outcomes: dict[str, int]  # as the summary's: finish reason, interrupted, in-flight -> count
    num_finished: int  # stop or length
    num_failed: int  # error or rejected
    num_prompt_tokens: int  # admitted prompts
    num_cached_tokens: int  # of which from the prefix cache
    num_prefilled_tokens: int  # of which computed
    num_output_tokens: int

    @classmethod
    def of(cls, summaries: Iterable[Summary]) -> EngineTotals:
        """The totals of `summaries` (an engine's: one, or one per model it serves)."""
        return cls.add(
            cls(
                num_requests=s.num_requests,
                outcomes=s.outcomes,
                num_finished=sum(s.outcomes.get(r, 0) for r in _FINISHED),
                num_failed=sum(s.outcomes.get(r, 0) for r in _FAILED),
                num_prompt_tokens=s.num_prompt_tokens,
                num_cached_tokens=s.num_cached_tokens,
                num_prefilled_tokens=s.num_prefilled_tokens,
                num_output_tokens=s.num_output_tokens,
            )
            for s in summaries
        )

    @classmethod
    def add(cls, totals: Iterable[EngineTotals]) -> EngineTotals:
        """`totals` added up."""
        outcomes: Counter[str] = Counter()
        sums = dict.fromkeys(_COUNTS, 0)
        for t in totals:
            outcomes.update(t.outcomes)
            for name in _COUNTS:
                sums[name] += getattr(t, name)
        return cls(outcomes=dict(outcomes.most_common()), **sums)


_COUNTS = tuple(name for name in EngineTotals.model_fields if name.startswith("num_"))


class EngineSummary(Report):
    """One engine's log: its summary (one per model, for a log several models share)."""

    engine: str  # its name (its log's file name; see the module's docstring)
    log: str  # its log's first file
    models: tuple[str, ...]  # what its first run's header says it serves
    totals: EngineTotals
    summary: Summary | ModelSummaries
    request_ids: tuple[str, ...]  # the requests it served (admitted or refused), in log order


class EngineSummaries(Report):
    """Several engines' logs side by side: each one's summary, their totals, and which
    engine served which request."""

    engines: tuple[EngineSummary, ...]  # in the order the logs were given
    totals: EngineTotals  # every engine's, added up
    # the engines' `request_ids` by request: id -> the engines whose logs hold it, in the
    # logs' order (two: a request retried on another engine?)
    requests: dict[str, tuple[str, ...]]

    def in_several(self) -> dict[str, tuple[str, ...]]:
        """The request ids that more than one engine's log holds."""
        return {rid: engines for rid, engines in self.requests.items() if len(engines) > 1}


class EngineRequest(Report):
    engine: str
    log: str
    timeline: RequestTimeline


class EngineRequests(Report):
    """One request id looked up in several engines' logs."""

    request_id: str
    logs: tuple[str, ...]  # the logs searched
    found: tuple[EngineRequest, ...]  # one per log that holds it (two: a retried request?)


class EngineVerify(Report):
    engine: str
    log: str
    report: VerifyReport | ModelVerifyReports


class EngineVerifyReports(Report):
    ok: bool  # every engine's log is
    engines: tuple[EngineVerify, ...]


def engine_names(logs: Sequence[Path]) -> tuple[str, ...]:
    """A name for each log's engine: its file name without the suffix, with as many of its
    parent folders as make every name different. Raises OverlappingLogsError for two logs of
    one set."""
    _check_apart(logs)
    paths = [p.absolute().with_suffix("") for p in logs]
    for depth in range(1, max(len(p.parts) for p in paths) + 1):
        names = tuple("/".join(p.parts[-depth:]) for p in paths)
        if len(set(names)) == len(names):
            return names
    return tuple(str(p) for p in logs)  # one folder, one stem: `a.jsonl`, `a.log`


def _check_apart(logs: Sequence[Path]) -> None:
    owner: dict[Path, int] = {}  # a file of a set -> the log (its place in `logs`) it is of
    for i, log in enumerate(logs):
        for file in log_files(log) or [log]:
            other = logs[owner.setdefault(file.resolve(), i)]
            if owner[file.resolve()] != i:
                what = (
                    f"{log} is given twice"
                    if other.resolve() == log.resolve()
                    else f"{other} and {log} are one log set ({file} is in both)"
                )
                raise OverlappingLogsError(
                    f"{what}: give each engine's log once, by its first file (its rotated "
                    "files are read with it)"
                )


def served_requests(path: str | Path) -> tuple[str, ...]:
    """The ids of the requests the log at `path` holds (admitted, or refused at a door), in
    the order they came. Raises what `read_run_events` raises."""
    ids: dict[str, None] = {}
    for _, event in scan_run_events(path):
        if event.type in ("admitted", "terminal"):
            ids.setdefault(event.request_id)
    return tuple(ids)


def _several_models(path: Path) -> bool:
    return any(r.header.models for r in read_runs(path))


def summarize_engine(
    path: Path, engine: str, *, progress: Callable[[int], None] | None = None
) -> EngineSummary:
    """The summary of one engine's log, as `summarize` (or `summarize_models`, for a log
    several models share) makes it. Raises what `summarize` raises."""
    if _several_models(path):
        by_model = summarize_models(path, progress=progress)
        summary: Summary | ModelSummaries = by_model
        summaries: tuple[Summary, ...] = by_model.models
    else:
        summary = summarize(path, progress=progress)
        summaries = (summary,)
    return EngineSummary(
        engine=engine,
        log=str(path),
        models=read_header(path).model_names,
        totals=EngineTotals.of(summaries),
        summary=summary,
        request_ids=served_requests(path),
    )


def summarize_engines(
    logs: Sequence[Path],
    *,
    progress: Callable[[Path], Callable[[int], None] | None] = lambda path: None,
) -> EngineSummaries:
    """Each engine's summary, their totals and which engine served which request.
    `progress(log)` gives the progress callback of that log's summary. Raises
    OverlappingLogsError and what `summarize` raises (naming the log it could not read)."""
    engines = []
    requests: dict[str, tuple[str, ...]] = {}
    for log, name in zip(logs, engine_names(logs), strict=True):
        engine = summarize_engine(log, name, progress=progress(log))
        engines.append(engine)
        for rid in engine.request_ids:
            requests[rid] = (*requests.get(rid, ()), name)
    return EngineSummaries(
        engines=tuple(engines),
        totals=EngineTotals.add(e.totals for e in engines),
        requests=requests,
    )


def find_request(logs: Sequence[Path], request_id: str) -> EngineRequests:
    """`request_id`'s timeline in each engine's log that holds it.

    Raises UnknownRequestError naming the logs searched if none holds it; what
    `request_timeline` raises for a log that holds it but cannot show it (refused at a door,
    in two runs of the log); OverlappingLogsError."""
    found = []
    for log, name in zip(logs, engine_names(logs), strict=True):
        try:
            timeline = request_timeline(log, request_id)
        except RequestNotInLogError:
            continue
        found.append(EngineRequest(engine=name, log=str(log), timeline=timeline))
    if not found:
        raise UnknownRequestError(
            f"no request {request_id!r} in any of the {len(logs)} logs searched: "
            + ", ".join(map(str, logs))
        )
    return EngineRequests(request_id=request_id, logs=tuple(map(str, logs)), found=tuple(found))


def verify_engines(logs: Sequence[Path]) -> EngineVerifyReports:
    """`verify` of each engine's log on its own (`verify_models` for a log several models
    share). Raises OverlappingLogsError and what `verify` raises."""
    engines = []
    for log, name in zip(logs, engine_names(logs), strict=True):
        report = verify_models(log) if _several_models(log) else verify(log)
        engines.append(EngineVerify(engine=name, log=str(log), report=report))
    return EngineVerifyReports(ok=all(e.report.ok for e in engines), engines=tuple(engines))
