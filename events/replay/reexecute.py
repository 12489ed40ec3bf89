"""Re-execution: feed a recorded run back through a fresh engine and compare its tokens.

The recorded requests (prompts, sampling parameters and seeds, checkpoints) are submitted in
their arrival order to an engine with the recorded budget (`max_step_tokens`,
`max_num_seqs`, `long_prefill_cap`, from the log header's `config`). Tokens are compared
request by request; the first divergence names the request, the position and both tokens.
In a log several models share, one model's requests are run again, on the model and with
the config of its first `model-loaded` event.

This module imports without MLX and without the API: what runs the requests again is the
caller's (`run_again`; api/reexecute.py runs them on a fresh `Engine`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from stepline.engine.sampling_limits import GREEDY_TEMPERATURE
from stepline.events.image_files import images_dir
from stepline.events.log import read_events, read_runs
from stepline.events.models import (
    AdapterLoaded,
    Admitted,
    FinishReason,
    LogHeader,
    ModelLoaded,
    RequestParams,
    Terminal,
    TokensSampled,
)

# The ends a re-execution compares whole (else only the tokens the recorded run produced).
_NORMAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.LOOP)


class _Report(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Divergence(_Report):
    request_id: str
    position: int  # index into the request's output tokens
    recorded: int | None  # None: the recorded run had ended here
    reexecuted: int | None  # None: the re-execution ended here


class RequestComparison(_Report):
    request_id: str
    outcome: Literal["same", "diverged", "skipped"]
    num_recorded_tokens: int
    num_reexecuted_tokens: int = 0
    recorded_finish: FinishReason | None = None
    reexecuted_finish: str | None = None
    divergence: Divergence | None = None
    note: str | None = None  # why skipped, or what else differed


class ReexecutePlan(_Report):
    """What re-execution can compare, known before anything runs."""

    num_requests: int
    num_comparable: int  # greedy or seeded, and ended so that its tokens can be compared
    skipped: dict[str, int]  # why skipped -> how many

    def describe(self) -> str:
        """'2 of 10 requests can be compared (greedy or seeded); 8 skipped: ...'."""
        text = (
            f"{self.num_comparable} of {self.num_requests} requests can be compared "
            "(greedy or seeded)"
        )
        if self.skipped:
            why = ", ".join(f"{n} {reason}" for reason, n in self.skipped.items())
            text += f"; {sum(self.skipped.values())} will be skipped: {why}"
        return text


class ReexecuteReport(_Report):
    path: str
    model: str | None  # what ran them again
    name: str | None = None  # in a log several models share: whose requests
    cannot_run: str | None = None  # why re-execution was impossible; nothing was run
    num_requests: int = 0
    num_same: int = 0
    num_diverged: int = 0
    num_skipped: int = 0
    first_divergence: Divergence | None = None  # in arrival order
    plan: ReexecutePlan | None = None  # what it could compare, known before it ran
    requests: tuple[RequestComparison, ...] = ()

    @property
    def num_compared(self) -> int:
        return self.num_same + self.num_diverged

    @property
    def ok(self) -> bool:
        """True when it ran, compared at least one request, and every one reproduced."""
        return self.cannot_run is None and self.num_compared > 0 and self.num_diverged == 0

    def describe(self) -> list[str]:
        if self.cannot_run:
            return [f"cannot re-execute {self.path}: {self.cannot_run}"]
        of = f"model {self.name} of {self.path}" if self.name is not None else self.path
        lines = [
            f"re-executed {self.num_requests} requests of {of} with {self.model}: "
            f"{self.num_same} same, {self.num_diverged} diverged, {self.num_skipped} skipped"
        ]
        if self.num_compared == 0:
            lines.append(
                "FAILED: nothing was compared, so nothing is verified: only greedy "
                "(temperature 0) or seeded requests reproduce; send requests with one of those "
                "to make a run re-executable"
            )
        d = self.first_divergence
        if d is not None:
            lines.append(
                f"first divergence: request {d.request_id} at output position {d.position}: "
                f"recorded {_tok(d.recorded)}, re-executed {_tok(d.reexecuted)}"
            )
        for r in self.requests:
            if r.outcome != "same":
                note = f" ({r.note})" if r.note else ""
                lines.append(f"  {r.request_id}: {r.outcome}{note}")
        return lines


def _tok(token: int | None) -> str:
    return "(end)" if token is None else str(token)


@dataclasses.dataclass
class RecordedRequest:
    admitted: Admitted
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None


@dataclasses.dataclass
class RecordedRun:
    header: LogHeader
    requests: list[RecordedRequest]  # in arrival order
    images_at: Path | None = None  # where the prompts' images were kept (image_files.py)
    name: str | None = None  # in a log several models share: the model they were sent to
    loaded: ModelLoaded | None = None  # that model's first load in the run
    # LoRA adapters loaded while it served (name -> path; those at start are in `config`)
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        """The engine config the requests were served with: the header's, or in a log several
        models share, the model's first load's."""
        if self.name is not None and self.header.models:
            return self.loaded.config if self.loaded is not None else {}
        return self.header.config

    @property
    def model(self) -> str | None:
        """What served them: the header's model, or in a log several models share, what the
        model's first load loaded (else what the header configures for it)."""
        if self.name is not None and self.header.models:
            if self.loaded is not None:
                return self.loaded.path
            return self.header.models.get(self.name, {}).get("model")
        return self.header.model or self.header.config.get("model")


def load_recorded_run(path: str | Path, run: int = 1, name: str | None = None) -> RecordedRun:
    """Every admitted request of one run of the log (1-based; of the model `name`, in a log
    several models share), with its recorded output tokens and finish reason. Raises
    IndexError for a run the log does not hold."""
    runs = read_runs(path)
    if not 1 <= run <= len(runs):
        raise IndexError(f"{path} holds {len(runs)} runs, not a run {run}")
    header = runs[run - 1].header
    by_id: dict[str, RecordedRequest] = {}
    loaded: ModelLoaded | None = None
    adapters: dict[str, str] = {}
    for event in read_events(path, run=run, model=name):
        if isinstance(event, ModelLoaded):
            loaded = loaded or event
        elif isinstance(event, AdapterLoaded):
            adapters.setdefault(event.name, event.path)
        elif isinstance(event, Admitted):
            by_id.setdefault(event.request_id, RecordedRequest(event))
        elif isinstance(event, TokensSampled):
            for one in event.decodings():
                rec = by_id.get(one.request_id)
                if rec is not None and rec.finish is None and one.token_ids is not None:
                    rec.output_token_ids.extend(one.token_ids)
        elif isinstance(event, Terminal):
            rec = by_id.get(event.request_id)
            if rec is not None and rec.finish is None:
                rec.finish = event.reason
    ordered = sorted(by_id.values(), key=lambda r: r.admitted.seq)
    return RecordedRun(
        header=header,
        requests=ordered,
        images_at=images_dir(path),
        name=name,
        loaded=loaded,
        adapters=adapters,
    )


def why_cannot_run(run: RecordedRun, model: str | None) -> str | None:
    """The reason re-execution is impossible for this log, or None."""
    names = run.header.model_names
    if run.header.models and run.name is None:
        return (
            f"the run holds {len(names)} models ({', '.join(names)}): pick the one to "
            "re-execute with --model"
        )
    if run.header.models and run.name not in names:
        return f"the run holds no model {run.name!r}: its models are {', '.join(names)}"
    if run.header.models and run.loaded is None and run.requests:
        return (
            f"model {run.name} has no model-loaded event in this run, so the log does not "
            "say how it was configured"
        )
    if not run.header.log_prompts or any(r.admitted.prompt_token_ids is None for r in run.requests):
        return (
            "the log was written with log_prompts=False, so it holds only each prompt's "
            "token count and SHA-256, not its tokens; record the run again with "
            "--log-prompts=true to make it re-executable"
        )
    if not run.header.log_outputs:
        return (
            "the log was written with log_outputs=False, so it holds how many tokens each "
            "request produced but not which: there is nothing to compare the new tokens with; "
            "record the run again with --log-outputs=true to make it re-executable"
        )
    if model is None:
        return "the log does not name its model: pass --model"
    return None


def _skip_reason(rec: RecordedRequest, images_at: Path | None = None) -> str | None:
    p = rec.admitted.params
    if rec.finish is FinishReason.REJECTED:
        return "rejected when recorded"
    if p.embed is not None:  # the log keeps no vector to compare with
        return "an embedding (no tokens to compare)"
    if rec.admitted.origin != "client":  # its one token is no answer; a client may preempt it
        return "the engine's own prefill of a next turn (no client's tokens)"
    if rec.admitted.images and (
        images_at is None or any(not (images_at / i.digest).is_file() for i in rec.admitted.images)
    ):
        return "its images were not kept beside the log"
    if p.temperature >= GREEDY_TEMPERATURE and p.seed is None:
        return "sampled without a seed, so not reproducible"
    if rec.finish not in _NORMAL_ENDS:
        if not rec.output_token_ids:
            return "produced no token when recorded"
    return None


def plan_reexecution(run: RecordedRun) -> ReexecutePlan:
    """Which requests of a recorded run re-execution compares, and why it skips the rest."""
    reasons = Counter(
        r for r in (_skip_reason(rec, run.images_at) for rec in run.requests) if r is not None
    )
    return ReexecutePlan(
        num_requests=len(run.requests),
        num_comparable=len(run.requests) - sum(reasons.values()),
        skipped=dict(reasons.most_common()),
    )


def _first_divergence(rid: str, recorded: list[int], got: list[int]) -> Divergence | None:
    for i, (a, b) in enumerate(zip(recorded, got, strict=False)):
        if a != b:
            return Divergence(request_id=rid, position=i, recorded=a, reexecuted=b)
    if len(recorded) != len(got):
        n = min(len(recorded), len(got))
        return Divergence(
            request_id=rid,
            position=n,
            recorded=recorded[n] if n < len(recorded) else None,
            reexecuted=got[n] if n < len(got) else None,
        )
    return None


def replay_params(rec: RecordedRequest) -> RequestParams:
    """The recorded params; a request cut short (cancelled, error, crash) is asked only for
    as many tokens as it produced, since only those can be compared."""
    p = rec.admitted.params
    if rec.finish in _NORMAL_ENDS:
        return p
    return p.model_copy(update={"max_tokens": len(rec.output_token_ids)})


# Each request run again -> (its tokens, its finish reason, why it could not run).
Results = dict[str, tuple[list[int], str | None, str | None]]
# What runs requests again: (the recorded run, the model to load, the requests in their
# recorded order, `on_progress`) -> their results. api/reexecute.py's `run_again` is one.
RunAgain = Callable[
    [RecordedRun, str, list[RecordedRequest], Callable[[int, int], None] | None],
    Awaitable[Results],
]


async def reexecute(
    path: str | Path,
    model: str | None = None,
    *,
    run_again: RunAgain,
    run: int | None = None,
    name: str | None = None,
    on_plan: Callable[[ReexecutePlan], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ReexecuteReport:
    """Run the requests of one run of the log again with `run_again` and compare tokens.

    `model` overrides what the log says was loaded; `run` (1-based) is needed when the log
    holds several runs; `name` picks the model whose requests run again in a log several
    models share (needed where the run holds more than one: it then runs on what that
    model's first `model-loaded` event loaded, configured as it says). Returns a report with
    `cannot_run` set (and nothing run) when the log cannot be re-executed, e.g. when it was
    written with log_prompts=False or log_outputs=False, or holds several runs and `run` is
    None. Before it runs anything it calls `on_plan` with what it can compare (when nothing
    can be, `run_again` is not called); `run_again` calls `on_progress(done, total)` as
    requests finish. Raises what `read_events` raises for an unreadable log.
    """
    prepared = prepare_reexecution(path, model, run=run, name=name)
    if isinstance(prepared, ReexecuteReport):
        return prepared
    recorded, model = prepared
    plan = plan_reexecution(recorded)
    if on_plan is not None:
        on_plan(plan)
    to_run = [rec for rec in recorded.requests if _skip_reason(rec, recorded.images_at) is None]
    results = await run_again(recorded, model, to_run, on_progress) if to_run else {}
    return compare_run(path, recorded, model, plan, results)


def prepare_reexecution(
    path: str | Path, model: str | None, *, run: int | None, name: str | None
) -> tuple[RecordedRun, str] | ReexecuteReport:
    """The recorded run to re-execute and the model to run it on; or, when it cannot be,
    the report that says why."""
    if run is None:
        num_runs = len(read_runs(path))
        if num_runs > 1:
            return ReexecuteReport(
                path=str(path),
                model=model,
                cannot_run=f"the log holds {num_runs} runs (the engine was restarted): "
                "pick one with --run",
            )
    header = read_runs(path)[(run or 1) - 1].header
    if name is None and len(header.models) == 1:
        (name,) = header.models  # the run's one model
    recorded = load_recorded_run(path, run or 1, name if header.models else None)
    model = model or recorded.model
    reason = why_cannot_run(recorded, model)
    if reason is not None:
        return ReexecuteReport(path=str(path), model=model, name=recorded.name, cannot_run=reason)
    assert model is not None  # why_cannot_run said so
    return recorded, model


def compare_run(
    path: str | Path, recorded: RecordedRun, model: str, plan: ReexecutePlan, results: Results
) -> ReexecuteReport:
    """The report of a re-execution: each recorded request against its `results` (those
    without: skipped, and why), in arrival order."""
    comparisons = []
    first: Divergence | None = None
    for rec in recorded.requests:
        skip = _skip_reason(rec, recorded.images_at)
        one = _skipped(rec, skip) if skip is not None else _compare(rec, results)
        if one.divergence is not None and first is None:
            first = one.divergence
        comparisons.append(one)
    ordered = tuple(comparisons)
    return ReexecuteReport(
        path=str(path),
        model=model,
        name=recorded.name,
        num_requests=len(ordered),
        num_same=sum(c.outcome == "same" for c in ordered),
        num_diverged=sum(c.outcome == "diverged" for c in ordered),
        num_skipped=sum(c.outcome == "skipped" for c in ordered),
        first_divergence=first,
        plan=plan,
        requests=ordered,
    )


def _skipped(rec: RecordedRequest, why: str) -> RequestComparison:
    return RequestComparison(
        request_id=rec.admitted.request_id,
        outcome="skipped",
        num_recorded_tokens=len(rec.output_token_ids),
        recorded_finish=rec.finish,
        note=why,
    )


def _compare(rec: RecordedRequest, results: Results) -> RequestComparison:
    """A request run again against its recording: the same tokens, and finished the same way
    where it finished normally."""
    rid = rec.admitted.request_id
    tokens, finish, error = results[rid]
    divergence = _first_divergence(rid, rec.output_token_ids, tokens)
    note = error
    if divergence is None and error is None and rec.finish in _NORMAL_ENDS:
        if finish is not None and finish != rec.finish.value:
            note = f"same tokens, but finished {finish} instead of {rec.finish.value}"
    diverged = divergence is not None or note is not None
    return RequestComparison(
        request_id=rid,
        outcome="diverged" if diverged else "same",
        num_recorded_tokens=len(rec.output_token_ids),
        num_reexecuted_tokens=len(tokens),
        recorded_finish=rec.finish,
        reexecuted_finish=finish,
        divergence=divergence,
        note=note,
    )
