"""Replay's summary: outcomes, latencies, scheduling figures and time, in one streaming pass.

A log of several runs is summarised run by run (requests, steps and sequence numbers start
afresh in each run) and in total; requests a run left unfinished before a restart are
`interrupted`, those unfinished when the log ends `in-flight`. A log several models share is
summarised model by model (`summarize_models`), each with its loads and unloads; each model's
events read as a log of that model alone.

The modules:
- `report.py`: the summary (`Summary`) and the calls that make it (`summarize`,
  `summarize_models`, and `request_why`, one request's why by the same fold);
- `fold.py`: the fold over the events, handing each to the parts it concerns; each part
  owns its figures and the report it makes of them:
- `requests.py`: how requests ended, their latencies, those left unfinished, next turns;
  their token totals, and why prefix-cache hits stopped short;
- `waits.py`: the waits between tokens, the longest (stalls) and their causes;
- `steps.py`: what the steps held, and how long they took against the step-time target;
- `drafts.py`: speculative decoding's drafts; `loads.py`: a model's loads and unloads.
"""

from __future__ import annotations

from stepline.events.replay.summary.fold import RunOverview
from stepline.events.replay.summary.loads import ModelLoads
from stepline.events.replay.summary.report import (
    ModelSummaries,
    Summary,
    request_why,
    summarize,
    summarize_models,
)
from stepline.events.replay.summary.steps import IdleGap, SlowStep
from stepline.events.replay.summary.waits import Stall

__all__ = [
    "IdleGap",
    "ModelLoads",
    "ModelSummaries",
    "RunOverview",
    "SlowStep",
    "Stall",
    "Summary",
    "request_why",
    "summarize",
    "summarize_models",
]
