"""The text `stepline replay` writes of each report (without `--json`): one function a
report, each returning its lines; `text_engines`, `text_request` and `text_verify_engines`
for several engines' logs (replay_engines.py). One request's timeline is
events/replay/request_text.py's, which the dashboard's server shows too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from stepline.api.cli.replay_output import RunReports
from stepline.events.models import EVENT_ADAPTER, Decoding
from stepline.events.replay import (
    InFlight,
    ModelLoads,
    ModelSummaries,
    ModelVerifyReports,
    Percentiles,
    SlowStep,
    StateAtStep,
    StepsReport,
    Summary,
    VerifyReport,
    describe_event,
    describe_status,
)
from stepline.events.replay.describe import describe_bytes
from stepline.events.replay.engines import (
    EngineRequests,
    EngineSummaries,
    EngineSummary,
    EngineTotals,
    EngineVerifyReports,
)
from stepline.events.replay.reexecute import ReexecuteReport
from stepline.events.replay.request_text import names_text as _names
from stepline.events.replay.request_text import plural as _plural
from stepline.events.replay.request_text import secs as _s
from stepline.events.replay.request_text import text_timeline

_IDS_SHOWN = 5  # request ids listed per engine (--json has them all)


def each_run(text: Callable[[Any], list[str]]) -> Callable[[BaseModel], list[str]]:
    """`text` of a report, or of each run's report of a log of several (`RunReports`)."""

    def render(report: BaseModel) -> list[str]:
        if not isinstance(report, RunReports):
            return text(report)
        lines: list[str] = []
        for one in report.runs:
            lines.append(f"== run {getattr(one, 'run', '?')} ==")
            lines.extend(text(one))
        return lines

    return render


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
    if s.prefix_misses:
        misses = ", ".join(f"{k} {n}" for k, n in s.prefix_misses.items())
        lines.append(
            f"prefix-cache hits short of the prompt, by why: {misses} "
            "(stepline replay --request ID says where each broke)"
        )
    if (nt := s.next_turns) is not None:
        ends = ", ".join(f"{k} {n}" for k, n in nt.outcomes.items())
        lines.append(
            f"next turns prefilled by the engine: {_plural(nt.num_requests, 'request')} "
            f"({ends}), {nt.num_prefilled_tokens} prompt tokens; not in the latencies above"
        )
    d = s.drafts
    if d is not None:
        lines.append(
            f"drafts: {d.num_proposed} proposed in {_plural(d.num_rows, 'decode row')} of "
            f"{_plural(d.num_requests, 'request')}, {d.num_accepted} kept "
            f"({100 * d.acceptance:.0f}%)"
        )
    return lines


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


def text_state(s: StateAtStep) -> list[str]:
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


def text_steps(report: StepsReport) -> list[str]:
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


def text_model_summaries(ms: ModelSummaries) -> list[str]:
    heading = (f"log {ms.files[0]}: ", ", each on its own (--model NAME for one)")
    return _model_by_model(heading, ms.models, text_summary)


def _model_by_model(heading: tuple[str, str], reports: Sequence[Any], text: Callable) -> list[str]:
    """A line naming the models between `heading`'s two parts, then each model's report as
    `text` writes one, under a line naming it."""
    names = [r.model or "?" for r in reports]
    lines = [f"{heading[0]}{len(names)} models ({', '.join(names)}){heading[1]}"]
    for one in reports:
        lines.append(f"== model {one.model} ==")
        lines.extend(text(one))
    return lines


def text_summary(s: Summary) -> list[str]:
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


def text_model_verify(mv: ModelVerifyReports) -> list[str]:
    file = mv.files[0] if mv.files else "?"
    lines = _model_by_model(
        (f"verify {file}: ", ", each verified on its own"), mv.models, text_verify
    )
    failed = [v.model or "?" for v in mv.models if not v.ok]
    lines.append(
        f"FAILED: violations in model {', '.join(failed)}"
        if failed
        else "OK: no violations in any model"
    )
    return lines


def text_verify(v: VerifyReport) -> list[str]:
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


def text_reexecute(report: ReexecuteReport) -> list[str]:
    return report.describe()


# ---------------------------------------------------------------------------------------------
# Several engines' logs.


def text_engines(es: EngineSummaries) -> list[str]:
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
        return text_summary(e.summary)
    return text_model_summaries(e.summary)


def text_request(er: EngineRequests) -> list[str]:
    where = ", ".join(f"{f.engine} ({f.log})" for f in er.found)
    if len(er.found) == 1:
        lines = [f"request {er.request_id}: served by engine {where}"]
        return lines + text_timeline(er.found[0].timeline)
    lines = [
        f"request {er.request_id} is in {len(er.found)} engines' logs (a retried request?): "
        + where
    ]
    for f in er.found:
        lines.append(f"== engine {f.engine} ==")
        lines.extend(text_timeline(f.timeline))
    return lines


def text_verify_engines(ev: EngineVerifyReports) -> list[str]:
    lines = [f"verify {len(ev.engines)} engines' logs, each on its own:"]
    for e in ev.engines:
        lines.append(f"== engine {e.engine} ==")
        report = e.report
        if isinstance(report, VerifyReport):
            lines.extend(text_verify(report))
        else:
            lines.extend(text_model_verify(report))
    failed = [e.engine for e in ev.engines if not e.report.ok]
    lines.append(
        f"FAILED: violations in the log of engine{'s' * (len(failed) > 1)} {', '.join(failed)}"
        if failed
        else "OK: no violations in any engine's log"
    )
    return lines
