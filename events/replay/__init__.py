"""Replay: answer questions about a recorded run from its event log alone.

Pure analysis, MLX-free, one streaming pass per question (constant memory in the length of
the log; proportional to the requests in it at most). One concern per module, gathered here:

- `request_timeline`, `state_at_step`, `step_records` (views.py): one request's life;
  every request's state as of a step, by the same `fold` the engine uses; per step, its
  members, tokens each, budget used and time taken;
- `summarize` (summary/): outcomes, latency percentiles, budget utilisation, stalls,
  slowest steps, idle time, requests in flight or interrupted;
- `verify` (verify.py): every violation of the engine's invariants, with the events
  that show it, by the fold's own rules;
- `Distribution`, `percentiles` (stats.py).

A log may hold several runs (a restart appends one): views take `run` (1-based index or run
id); the summary and verify cover every run, each on its own. A log may be shared by several
models (a server of several): views take `model`; `summarize_models` and `verify_models`
cover each model on its own, and the views of steps and states need one model
(`ModelNeededError`).
"""

from __future__ import annotations

from stepline.events.replay.describe import (
    InFlight,
    ModelNeededError,
    RunNeededError,
    UnknownModelError,
    UnknownRequestError,
    UnknownRunError,
    describe_event,
    describe_status,
    describe_tokens,
    resolve_model,
    resolve_run,
)
from stepline.events.replay.stats import Distribution, Percentiles, percentiles
from stepline.events.replay.summary import (
    IdleGap,
    ModelLoads,
    ModelSummaries,
    RunOverview,
    SlowStep,
    Stall,
    Summary,
    summarize,
    summarize_models,
)
from stepline.events.replay.verify import (
    ModelVerifyReports,
    VerifyReport,
    Violation,
    ViolationKind,
    verify,
    verify_models,
)
from stepline.events.replay.views import (
    RequestAtStep,
    RequestTimeline,
    StateAtStep,
    StepMember,
    StepRecord,
    StepsReport,
    request_timeline,
    state_at_step,
    step_records,
)

__all__ = [
    "Distribution",
    "IdleGap",
    "InFlight",
    "ModelLoads",
    "ModelNeededError",
    "ModelSummaries",
    "ModelVerifyReports",
    "Percentiles",
    "RequestAtStep",
    "RequestTimeline",
    "RunNeededError",
    "RunOverview",
    "SlowStep",
    "Stall",
    "StateAtStep",
    "StepMember",
    "StepRecord",
    "StepsReport",
    "Summary",
    "UnknownModelError",
    "UnknownRequestError",
    "UnknownRunError",
    "VerifyReport",
    "Violation",
    "ViolationKind",
    "describe_event",
    "describe_status",
    "describe_tokens",
    "percentiles",
    "request_timeline",
    "resolve_model",
    "resolve_run",
    "state_at_step",
    "step_records",
    "summarize",
    "summarize_models",
    "verify",
    "verify_models",
]
