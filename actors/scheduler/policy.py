"""The scheduling policy: a pure function from scheduling state to one step's plan.

No MLX, no I/O, no clock. Per step, within `max_step_tokens` and `max_num_seqs`:
0. where a client runs more than its share of the seats while another's request waits for
   one, its newest decoding requests are parked after this step, and parked ones take free
   seats again after it (seats.py);
1. every decoding request gets one token (oldest first, if the budget is short);
2. each drafting row's drafts get what the budget and the time leave (drafter.py);
3. prompts get what is left, mid-prefill or waiting alike, in the order order.py gives
   them (shortest prompt left first, one that has not moved for `MAX_WAIT_STEPS` steps
   before every other, fair share between clients). A waiting request starts only if a slot
   is free and its KV fits (counted as the running requests decode: in one batch, every row
   padded to the longest). Each tries the step's budget (budget.py `StepBudget`), which
   takes what fits and says why nothing did.
A chunk is min(remaining prompt, budget left, long-prefill cap).

With a cost model (`StepCost`, fitted by actors/scheduler/cost_model.py) and decode rows to
protect, chunks are also sized so that the step's predicted time stays under `max_step_ms`:
they shrink as their context grows and as decode rows are added. The first prompt in the
order always gets at least one token, so nothing starves. Within the target a step is no
longer than it takes to give the prompt's own work PREFILL_SHARE of it (where the
overheads, the decode rows and a chunk's fixed cost, are small, a longer step stalls the
decoders for little gain), and it is never so short that the overheads take more than
1 - MIN_PREFILL_SHARE of it: on a machine where they are large beside the target, the step
stretches so that the prompt's own work keeps most of it (every step pays the overheads,
and a prompt cut into many small chunks would wait far longer for its first token than it
takes to compute). `step_seconds` (budget.py) says how long a step may be. With nobody
decoding there is nobody to protect: a lone prompt prefills in chunks as big as the token
rules allow.

Images (`RequestState.images`, a vision model's prompts). A prompt that reaches an image
whose encoder work is not done gets encoder units next, not tokens: beside decode rows, as
many as keep the step within what it would take with a text prompt of the request's length
as its next chunk (its tokens to compute, cut by the token rules and the time left: units
are work its tokens do not count, and a short prompt's image packed up to the step's time
stalled the streams 2-3x what its text would); priced `per_encode_unit`, a clip's
`per_audio_unit`; at least one for a step's first work, so an encoder dearer than the target
still moves; all of them with nobody decoding, or without a cost model. No chunk reaches
into an image before its units are done. Then its tokens are
chunked as text, or, for an image that goes `whole`, in one chunk: cut before it when it
does not fit what is left of the step, and run alone, past the budget, by the step's first
prompt when no step would hold it.

A plan says why it is what it is: what sized each chunk (`ScheduledChunk.limit`) and which
requests sat the step out and why (`StepPlan.held`: held.py). Admission stops for the step
(the waiting requests behind are held for the same reason) when a waiting request gets no
time or meets an image span that does not fit, or when an aged one's KV does not fit (a
young one whose KV does not fit waits, and one behind it may fit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter

from stepline.actors.scheduler.budget import Refused, StepBudget
from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.held import oldest_held
from stepline.actors.scheduler.order import RUNNING, PromptOrder, is_aged
from stepline.actors.scheduler.plan import SchedulerConfig, StepPlan
from stepline.actors.scheduler.prefix_index import PrefixPlan
from stepline.actors.scheduler.seats import seat_moves
from stepline.actors.scheduler.spans import next_encode
from stepline.events.fold import RequestState, Status
from stepline.events.models import HeldReason

_arrival = attrgetter("admitted_seq")


def schedule(
    states: Mapping[str, RequestState],
    config: SchedulerConfig,
    step: int,
    cost: StepCost | None = None,
    prefix: PrefixPlan | None = None,
    drafts: Mapping[str, Sequence[int]] | None = None,
) -> StepPlan:
    """Build step `step`'s plan from every unfinished request's state.

    With `cost`, chunks are also sized to keep the predicted step time under
    `config.max_step_ms` while there are decode rows (see the module docstring).
    `prefix` says where waiting requests start (their cache hits) and which of them wait
    for a prefix another request is computing (`prefix_index.plan_prefixes`).
    `drafts`: the tokens each drafting request proposes (`actors/scheduler/drafter.py`); they get
    what the budget and the time leave after every decode row's token, before any prompt.
    """
    prefix = prefix or PrefixPlan()
    live = sorted((s for s in states.values() if not s.is_finished), key=_arrival)
    seats = seat_moves(live, config.max_num_seqs)
    running = [s for s in live if s.status in RUNNING and not s.parked]
    parked = [s for s in live if s.parked]
    # the decode rows: a token each; the parked ones resuming hold their seats already
    budget = StepBudget(config, cost, running, parked, len(seats.resumes))
    for rid in budget.decodes:
        if drafts and (proposed := drafts.get(rid)) is not None:
            budget.try_draft(states[rid], proposed)

    order = PromptOrder.of(running, live, prefix, step, config.max_num_seqs)
    closed: HeldReason | None = None  # why waiting requests may no longer start this step
    held: dict[str, HeldReason] = {}  # prompts left out for their own reasons, and why
    out_of_budget = False  # the budget ran out before the order's end
    last_started = -1  # the last waiting request of those fair share kept that started
    for i, (s, start) in enumerate(order.prompts):
        waiting = s.status is Status.WAITING
        if waiting and closed is not None:
            continue  # held for `closed` (`oldest_held`'s `waiting`)
        image = next_encode(s, start)
        if image is None:
            refused = budget.try_prompt(s, start)
        else:
            refused = budget.try_encode(s, image, start)
        if refused is None:
            if waiting and i < order.num_kept:
                last_started = i
        elif refused is Refused.TOKENS:
            out_of_budget = True
            break
        elif refused is not Refused.SEQS:  # else held for max-num-seqs (`oldest_held`)
            held[s.request_id] = refused.reason
            # an aged request whose KV does not fit holds back the younger ones
            if waiting and (refused is not Refused.KV or is_aged(s, step)):
                closed = refused.reason

    if closed is None:  # why the waiting requests left out with no reason of their own were
        closed = "budget" if out_of_budget and not budget.is_full else "max-num-seqs"
    went_before = order.went_before(last_started) if order.has_moved and last_started >= 0 else None
    return budget.plan(
        step,
        oldest_held(live, budget.scheduled, held, prefix.deferred, closed, went_before=went_before),
        seats,
    )
