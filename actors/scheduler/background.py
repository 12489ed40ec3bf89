"""The engine's own requests (`Admitted.origin` other than "client": a chat's next turn,
prefilled once it ended, api/pipeline/next_turn.py) take only what no client's request wants.

- One that waits starts only while no client's request waits (order.py `startable`), and in a
  step its chunks come after every client prompt's (`admission_key`): it never takes a step's
  tokens, a seat or KV that a client's request could have had this step.
- It counts in no client's fair share (order.py, seats.py): it is not its client's running
  request, and its client is not one more client to share the seats with.
- One that runs is ended (cancelled: `PREEMPTED`) as soon as a client's request waits for the
  seat or the KV it holds (`preemptions`), newest first; its prefill so far is lost, which is
  all it costs (the next request computes that prefix itself).
- It takes no room of the waiting queue that a client's request wants (admission.py
  `check_queue`).
"""

from __future__ import annotations

from collections.abc import Sequence

from stepline.actors.scheduler.batch_geometry import batch_kv_tokens, kv_length
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.fold import RequestState, Status

# The message a preempted request ends with (reason cancelled).
PREEMPTED = "preempted: a client's request needs its seat or its KV"

_RUNNING = (Status.PREFILLING, Status.DECODING)


def clients_waiting(live: Sequence[RequestState]) -> bool:
    """Whether some client's request waits for its first chunk."""
    return any(s.status is Status.WAITING and not s.is_background for s in live)


def preemptions(live: Sequence[RequestState], config: SchedulerConfig) -> tuple[str, ...]:
    """The engine's own running requests to end before the next step (`live`: every unfinished
    request, oldest first), newest first: as many as give each waiting client's request a seat
    (up to the seats they hold), then, with a KV budget, as many as let the oldest waiting
    client's request's KV fit beside the rest."""
    ours = [s for s in live if s.is_background and s.status in _RUNNING and not s.parked]
    if not ours:
        return ()
    waiting = [s for s in live if s.status is Status.WAITING and not s.is_background]
    if not waiting:
        return ()
    ours.reverse()  # newest first
    seated = sum(1 for s in live if s.status in _RUNNING and not s.parked)
    short = len(waiting) - (config.max_num_seqs - seated)
    ended = ours[: max(0, short)]
    max_kv = config.max_kv_tokens
    if max_kv is not None:
        gone = {s.request_id for s in ended}
        kept = {s.request_id: kv_length(s) for s in live if s.status in _RUNNING}
        first = kv_length(waiting[0])
        for s in ours[len(ended) :]:
            lengths = [n for rid, n in kept.items() if rid not in gone]
            if batch_kv_tokens([*lengths, first], config) <= max_kv:
                break
            ended.append(s)
            gone.add(s.request_id)
    return tuple(s.request_id for s in ended)
