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
- One that went stale is ended (cancelled: `STALE`), freeing its seat and KV: its client's
  next request of the same conversation arrived (`stale`), and either does not start with its
  prompt (the prediction missed: nothing it computes serves) or finds it not started yet
  (that request computes the prefix itself, in its own chunks). One under way that the
  request does start with goes on: the request waits for its snapshot (prefix_index.py
  `plan_prefixes`) and starts from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from stepline.actors.scheduler.batch_geometry import batch_kv_tokens, kv_length
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.fold import RequestState, Status

# The message a preempted request ends with (reason cancelled).
PREEMPTED = "preempted: a client's request needs its seat or its KV"
STALE = "stale: its client's next request arrived and does not need it"

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


def stale(live: Sequence[RequestState]) -> tuple[str, ...]:
    """The engine's own requests (`live`: every unfinished request) that their client's
    newer request made pointless, oldest first: a client's request of the same client and
    adapter, admitted after it, of the same conversation (its prompt starts with at least
    the first half of the prefill's: another session of the client, a subagent, shares its
    system prompt with it, not its history), that does not start with the whole prompt, or
    that does while the prefill has not started."""
    ours = [s for s in live if s.is_background and s.prompt_token_ids]
    if not ours:
        return ()
    clients = [s for s in live if not s.is_background and s.prompt_token_ids]
    ended = []
    for s in ours:
        prompt = s.prompt_token_ids or ()
        half = prompt[: (len(prompt) + 1) // 2]
        for c in clients:
            if c.admitted_seq < s.admitted_seq or (c.client, c.adapter) != (s.client, s.adapter):
                continue
            theirs = c.prompt_token_ids or ()
            if theirs[: len(half)] != half:
                continue  # another conversation
            if s.status is Status.WAITING or theirs[: len(prompt)] != prompt:
                ended.append(s.request_id)
                break
    return tuple(ended)
