"""Who holds a seat: fair share between clients while requests run, not only as they start.

A seat is a row of the step (`max_num_seqs` of them): a running request holds one from its
first chunk to its end. order.py shares the seats as requests start; that alone lets one
client keep every seat once it has them — 200 streams nobody reads run to `max_tokens`, and
another client's 8-token chat waits for one of them to end. So where a client runs more than
its share (`max_num_seqs` / the clients with live requests, at least one) and another
client's request waits for a seat its client is owed, the first client's newest decoding
requests are parked: each decodes this step, then leaves the decode batch with its cache
(`Parked`), and takes a seat again (`Resumed`, back in the batch after a step and decoding
from the next) once one is free that no client below its share waits for — before any new
request of its own client starts. Nothing is lost or
recomputed: a parked request's tokens come exactly as they would have, later.

A parked request keeps its KV (the budget counts it); a prefilling one is never parked (its
chunks are its own progress). With one client, nothing is ever parked. The engine's own
requests (background.py) are nobody's share: they are ended, not parked, when a client's
request needs their seat.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from stepline.actors.scheduler.order import RUNNING
from stepline.events.fold import RequestState, Status


@dataclass(frozen=True)
class SeatMoves:
    """A step's changes of seat, made after it: requests that decode this step and are
    parked after it, and parked requests that take a seat (this step's) and decode from the
    next."""

    parks: tuple[str, ...] = ()
    resumes: tuple[str, ...] = ()


NO_MOVES = SeatMoves()


def share_of(live: Sequence[RequestState], max_num_seqs: int) -> int:
    """The seats each client with live requests is owed (at least one)."""
    return max(1, max_num_seqs // max(1, len({s.client for s in live})))


def seat_moves(live: Sequence[RequestState], max_num_seqs: int) -> SeatMoves:
    """Which requests of `live` (every unfinished request, oldest first) change seat this step
    (see the module docstring)."""
    if any(s.is_background for s in live):
        live = [s for s in live if not s.is_background]
    if not any(s.parked or s.status is Status.WAITING for s in live):
        return NO_MOVES  # every step while requests only decode: nothing to weigh
    parked = [s for s in live if s.parked]
    owed = Counter[str | None]()  # per client below its share: the seats it waits for
    seated = Counter(s.client for s in live if s.status in RUNNING and not s.parked)
    held = Counter(s.client for s in parked)  # a client's parked requests go before its new
    share = share_of(live, max_num_seqs)
    waiting = Counter(s.client for s in live if s.status is Status.WAITING)
    for client, n in waiting.items():
        room = share - seated[client] - held[client]
        if room > 0:
            owed[client] = min(n, room)
    free = max_num_seqs - sum(seated.values())
    wanted = sum(owed.values())
    if wanted > free:
        return SeatMoves(parks=_parks(live, seated, share, wanted - free))
    if not parked or free <= wanted:
        return SeatMoves()
    # Seats left once the waiting clients below their share are served: parked requests of
    # clients below their share first, then the others, oldest first.
    order = sorted(parked, key=lambda s: (seated[s.client] >= share, s.admitted_seq))
    resumes = []
    for s in order[: free - wanted]:
        resumes.append(s.request_id)
        seated[s.client] += 1
    return SeatMoves(resumes=tuple(resumes))


def _parks(
    live: Sequence[RequestState], seated: Counter[str | None], share: int, needed: int
) -> tuple[str, ...]:
    """Up to `needed` decoding requests to park: of the clients most over their share, each
    one's newest first, none taking a client below its share."""
    decoding: dict[str | None, list[RequestState]] = defaultdict(list)
    for s in live:
        if s.status is Status.DECODING and not s.parked:
            decoding[s.client].append(s)
    over = dict(seated)
    parks: list[str] = []
    while len(parks) < needed:
        over_share = [c for c in decoding if decoding[c] and over[c] > share]
        if not over_share:
            break
        client = max(over_share, key=lambda c: over[c])
        parks.append(decoding[client].pop().request_id)  # its newest
        over[client] -= 1
    return tuple(parks)
