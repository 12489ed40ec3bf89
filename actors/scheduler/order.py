"""The order prompts get a step's room in, and fair share between clients.

Prompts, mid-prefill or waiting alike, go shortest prompt left first (what is left of it
after its cached prefix), so that a burst of requests, or a chat arriving while a long
prompt prefills, gets its first token early; but a prompt that has not moved for
`MAX_WAIT_STEPS` steps (since it was admitted, or since its last chunk) goes before every
other (oldest first among those), so a long prompt is held back for a bounded number of
steps, never forever (`admission_key`).

Fair share between clients (`RequestState.client`: an API key and `user`, over HTTP). A
client's share is `max_num_seqs` / the clients with live requests. While more than one
client waits, a waiting request whose client would already run its share when it starts
goes after every other prompt (`fair_order`): one client's hundreds of requests, aged or
not, do not keep another's chat from the next free slot. The held ones go the client with
fewer running first, then in the order above. With one client waiting, the order is
exactly the one above. A client that already runs more than its share while another's
request waits steps aside for it as well: its newest decoding requests are parked until a
seat frees (seats.py). A client may also fill at most three quarters of the waiting queue
(`SchedulerConfig.max_waiting_per_client`, admission.py `check_queue`): the rest is kept
for others.

The engine's own requests (a next turn's prefill: `RequestState.is_background`) go after
every client's prompt, start only while no client's request waits, and count in no client's
share (background.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial

from stepline.actors.scheduler.background import clients_waiting
from stepline.actors.scheduler.prefix_index import PrefixPlan
from stepline.events.fold import RequestState, Status

# Prompts go shortest first; one that has not moved for this many steps goes before every
# other. A burst of 16 chats of 32-512 tokens on stepline-demo:
# its median time to first token was about 0.8x that of admitting oldest first.
MAX_WAIT_STEPS = 8

RUNNING = (Status.PREFILLING, Status.DECODING)

Prompt = tuple[RequestState, int]  # a request, and where its next chunk starts


def is_aged(s: RequestState, step: int) -> bool:
    """Whether request `s`'s prompt has not moved for `MAX_WAIT_STEPS` steps by step `step`
    (since it was admitted, or since its last chunk)."""
    return step - s.moved_step >= MAX_WAIT_STEPS


def admission_key(s: RequestState, step: int, start: int) -> tuple[bool, bool, int, int]:
    """Sort key of the prompts' order, for a prompt whose next chunk starts at `start`:
    clients' before the engine's own (background.py); then aged ones first (`is_aged`),
    oldest first; then the others, shortest prompt left first, ties oldest first."""
    if is_aged(s, step):
        return (s.is_background, False, 0, s.admitted_seq)
    return (s.is_background, True, s.num_prompt_tokens - start, s.admitted_seq)


def first_chunk_start(s: RequestState, prefix: PrefixPlan) -> int:
    """Where waiting request `s`'s first chunk starts: after its cache hit, if it has one."""
    return prefix.cached.get(s.request_id, s.num_computed_tokens)


def startable(live: list[RequestState], prefix: PrefixPlan) -> list[RequestState]:
    """Waiting requests that may start this step (ordered among the prompts by
    `admission_key`, with each one's cache hit). Only requests the prefix plan looked at
    may start (it looks at a window of the queue: the others' cache hits are unknown); the
    engine's own only while no client's request waits (background.py)."""
    ours_may = not clients_waiting(live)
    return [
        s
        for s in live
        if s.status is Status.WAITING
        and s.request_id not in prefix.deferred
        and (prefix.considered is None or s.request_id in prefix.considered)
        and (ours_may or not s.is_background)
    ]


def fair_order(
    prompts: list[Prompt], live: Collection[RequestState], max_num_seqs: int
) -> list[Prompt]:
    """`prompts` (in the order `admission_key` gives them) with fair share between the
    clients of the `live` requests, a client's share being `max_num_seqs` / the number of
    clients with live requests. Where more than one client waits, a waiting request whose
    client would already run its share when it starts (those of its client before it counted
    as started) goes after every other prompt; the held ones go fewest running first, then
    in their order. With one client waiting, `prompts` as they are."""
    kept, held = fair_split(prompts, live, max_num_seqs)
    return kept + held if held else kept


def fair_split(
    prompts: list[Prompt], live: Collection[RequestState], max_num_seqs: int
) -> tuple[list[Prompt], list[Prompt]]:
    """`fair_order`'s order in two parts: the prompts that keep their place, and those that
    go after them (none with one client waiting)."""
    waiting = {s.client for s, _ in prompts if s.status is Status.WAITING and not s.is_background}
    if len(waiting) < 2:
        return prompts, []
    share = max_num_seqs / len({s.client for s in live if not s.is_background})
    running = Counter(s.client for s in live if s.status in RUNNING and not s.is_background)
    kept: list[Prompt] = []
    held: list[tuple[int, int, Prompt]] = []
    for i, p in enumerate(prompts):
        s = p[0]
        if s.status is Status.WAITING and not s.is_background:
            place = running[s.client]  # its client's running requests when it starts
            running[s.client] += 1
            if place >= share:
                held.append((place, i, p))
                continue
        kept.append(p)
    held.sort(key=lambda h: h[:2])
    return kept, [p for _, _, p in held]


@dataclass(frozen=True)
class PromptOrder:
    """A step's prompts in the order they get its room: those mid-prefill, and the waiting
    ones that may start (`startable`, each from its cache hit), by `admission_key`, fair
    share applied (`num_kept`: how many keep their place; those after them were moved back
    by it)."""

    prompts: Sequence[Prompt]
    num_kept: int
    step: int
    prefix: PrefixPlan

    @classmethod
    def of(
        cls,
        running: Sequence[RequestState],
        live: list[RequestState],
        prefix: PrefixPlan,
        step: int,
        max_num_seqs: int,
    ) -> PromptOrder:
        prompts = [(s, s.num_computed_tokens) for s in running if s.status is Status.PREFILLING]
        prompts += [(s, first_chunk_start(s, prefix)) for s in startable(live, prefix)]
        prompts.sort(key=lambda p: admission_key(p[0], step, p[1]))
        kept, moved = fair_split(prompts, live, max_num_seqs)
        return cls(kept + moved if moved else kept, len(kept), step, prefix)

    @property
    def has_moved(self) -> bool:
        """Fair share moved some waiting request back."""
        return len(self.prompts) > self.num_kept

    def went_before(self, i: int) -> Callable[[RequestState], bool]:
        """Whether a waiting request goes before prompt `i` of the order but for fair share:
        the test of a held request's "fair-share" (held.py `oldest_held`)."""
        last, at = self.prompts[i]
        return partial(_goes_before, admission_key(last, self.step, at), self.step, self.prefix)


def _goes_before(
    key: tuple[bool, bool, int, int], step: int, prefix: PrefixPlan, s: RequestState
) -> bool:
    return s.status is Status.WAITING and admission_key(s, step, first_chunk_start(s, prefix)) < key
