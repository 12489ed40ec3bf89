"""Driving the scheduler core without a model, as vLLM's scheduler tests do: make a core,
`add`, `schedule()`, feed a hand-made result to `update_from_output`, assert on counts."""

from __future__ import annotations

from stepline.actors.scheduler.core import ModelLimits, SchedulerCore, StepOutcome
from stepline.actors.scheduler.cost_model import StepCost, StepFeatures
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.work import StepResult, StepWork
from stepline.events.models import RequestParams

EOS = 2
TOKEN = 7  # what the hand-made results sample: never EOS, so requests end by length
LIMITS = ModelLimits(max_context=1 << 16, eos_token_ids=frozenset({EOS}))


def params(max_tokens: int = 3, **kw) -> RequestParams:
    return RequestParams(
        max_tokens=max_tokens, temperature=0, top_p=1, top_k=0, min_p=0, seed=None, **kw
    )


class FixedCost:
    """A cost model that has learned `cost` and learns nothing more (what the core reads of
    `engine.cost_model.CostModel`): chunks are sized by exactly these coefficients."""

    def __init__(self, cost: StepCost) -> None:
        self.cost = self.last = cost

    def observe(self, features: StepFeatures, seconds: float) -> None:
        pass


def make_core(
    max_step_tokens: int = 64,
    *,
    config: SchedulerConfig | None = None,
    cost: StepCost | None = None,
    limits: ModelLimits = LIMITS,
    **kw,
) -> SchedulerCore:
    """A core of `config` (default: `max_step_tokens`, 4 sequences, tokens only) for a model
    of `limits`, its steps priced by `cost` if given."""
    if config is None:
        config = SchedulerConfig(max_step_tokens=max_step_tokens, max_num_seqs=4, max_step_ms=None)
    cost_model = FixedCost(cost) if cost is not None else None
    return SchedulerCore(config, limits, cost_model=cost_model, **kw)


def sampled(work: StepWork, token: int = TOKEN, **extra) -> StepResult:
    """What a model would return for `work`: `token` for every decode row and final chunk."""
    plan = work.plan
    rows = [*plan.decodes, *(c.request_id for c in plan.chunks if c.is_final)]
    return StepResult(tokens={rid: token for rid in rows}, **extra)


def run_step(core: SchedulerCore, token: int = TOKEN, **extra) -> tuple[StepWork, StepOutcome]:
    """Schedule a step, check it keeps the budget and the sequence limit, and apply what a
    model would return for it (`sampled`)."""
    work = core.schedule()
    assert work is not None
    plan, config = work.plan, core.config
    assert plan.num_tokens <= config.max_step_tokens
    assert len(plan.num_scheduled_tokens) <= config.max_num_seqs
    return work, core.update_from_output(work, sampled(work, token, **extra))
