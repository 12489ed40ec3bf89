"""Who sat a step out, and why: the requests that could have joined a step's plan (waiting,
or mid-prefill) and did not, as `policy.schedule` records them in `StepPlan.held`.

A held request's reason is the first of the policy's checks, in the order it makes them,
that stopped it, except that for a waiting request admission's own checks (closed, the
slots) go before the budget (`HeldReason`):
- "budget": no token of the step's budget was left when its turn came;
- "max-num-seqs": `max_num_seqs` requests were running (for a waiting one);
- "kv": its KV does not fit beside the running requests', or an older one's does not and
  holds admission back (the waiting ones behind it wait too);
- "time": the step-time target left its next chunk (or encoder unit) no time, or an earlier
  waiting request's, which stops admission for the step;
- "image": its next chunk would end inside an image span that goes whole (or an earlier
  waiting request's would: admission stops);
- "prefix": it waits for a prefix an earlier request is computing, or for its cache entry
  to load from disk;
- "fair-share": its client ran its share, so it went after the other clients' prompts,
  and another client's waiting request that it would have gone before started, while the
  budget, `max_num_seqs` or the time target held it.
Waiting requests past the window of the queue the prefix plan looked at (`max_num_seqs`
of them, in admission order) are held like those the policy's order did not reach: for
what closed admission, else "max-num-seqs" if the slots are full, else "budget" if it ran
out, else "max-num-seqs" (a step looks at no more than that many waiting requests).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

from stepline.events.fold import RequestState, Status
from stepline.events.models import MAX_HELD, HeldReason

# the reasons that a prompt going before it (fair share moved it back) may be the cause of
_SHARED: Container[HeldReason] = ("budget", "max-num-seqs", "time")


def oldest_held(
    live: Sequence[RequestState],
    scheduled: Container[str],
    reasons: Mapping[str, HeldReason],
    deferred: Container[str],
    waiting: HeldReason,
    went_before: Callable[[RequestState], bool] | None = None,
) -> tuple[tuple[str, HeldReason], ...]:
    """The oldest `MAX_HELD` requests of `live` (oldest first, as `live` is) that are
    waiting or mid-prefill and not among `scheduled`, each with why: `reasons`' word for
    it (those the policy left out for their own reasons), else "prefix" if it is
    `deferred`, else `waiting` for a waiting one (what closed admission, or the slots, or
    the budget) and "budget" for one mid-prefill (the budget ran out before its turn). One
    held for a shared resource (the
    budget, the slots, the time) is held for "fair-share" where `went_before(state)` says
    a request it would have gone before but for fair share started."""
    held: list[tuple[str, HeldReason]] = []
    decoding, not_started = Status.DECODING, Status.WAITING
    for s in live:
        if s.status is decoding or (rid := s.request_id) in scheduled:
            continue
        reason = reasons.get(rid)
        if reason is None:
            if s.status is not_started:
                reason = "prefix" if rid in deferred else waiting
            else:
                reason = "budget"
        if went_before is not None and reason in _SHARED and went_before(s):
            reason = "fair-share"
        held.append((rid, reason))
        if len(held) == MAX_HELD:
            break
    return tuple(held)
