"""The events as they are recorded, for readers that follow them live (`GET /v1/events`,
api/http/events.py, and the dashboard it feeds).

`EventFeed.publish` is called where the step loop hands its events to the log's writer, on
the event loop's thread: it puts them in a ring of the last `capacity` events and wakes the
readers that wait. That is O(1) an event: no I/O, no serialising, no lock, never a wait.

Each reader (`EventFeed.follow`) keeps nothing but its place in the ring, so its buffer is
the ring's window: a reader that stops reading (its socket full) holds no more memory as the
engine goes on, and when it reads again past the window it is told how many events it
missed (`Missed`), then goes on from the oldest event still kept. Events the ring no longer
holds are read back from the log file, where there is one (a reader resuming after a gap, or
after a restart of the server: the run it had read is in the file).

A page that draws the engine's state now need not read all the ring to get there
(`EventFeed.follow_view`): it is sent the events its picture needs — the requests' in flight
and the last VIEW_ENDED that ended, the plans and times of the last VIEW_STEPS steps, the
models' — then `CaughtUp` (where that catch-up ends, how many of how many it sent, each
request's tokens so far, the prefix cache's lookups over the whole run: `PrefixTally`), then
every event after, as any reader. What it sends does not grow with what memory keeps, nor
with how long a request has run.

Places: the N-th event a run recorded (from 1) is at `Place(run, N)`, written `RUN.N`, where
RUN is the run's id (`LogHeader.run_id`; `run-I` for the I-th run of an old log that has
none). In a server of one model N is the event's `seq`; in a log several models share, each
model's `seq` counts on its own and N is the event's place in the log. A frame's SSE `id` is
its place, so a client's `Last-Event-ID` says where to go on.

The stream carries each event as the log holds it (`model_dump_json`, `model` left out when
it is the run's one), less a prompt's token ids (its count and digest stay): the ring would
keep every long prompt alive, and a frame of megabytes helps no dashboard.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel

from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    Event,
    ImageEncoded,
    LogHeader,
    Terminal,
    TokensSampled,
)

DEFAULT_CAPACITY = 16384  # events kept in memory (about a minute of a busy engine's steps)
MAX_BATCH = 1024  # events a reader takes from the ring (or the file) at a time
GATHER_S = 0.02  # a woken reader lets a few steps' events gather before it reads them
VIEW_STEPS = 150  # steps a view's catch-up keeps the plans and times of (the page's strip)
VIEW_ENDED = 25  # ended requests it keeps the lives of (the page's "recently ended")
_STEP_TYPES = frozenset({"step", "step-finished"})

_NO_MODEL = frozenset({"model"})


class Place(NamedTuple):
    """The N-th event (from 1) of the run named `run`; N = 0: before its first."""

    run: str
    n: int

    def __str__(self) -> str:
        return f"{self.run}.{self.n}"


def parse_place(text: str) -> Place:
    """The place written `RUN.N` (`Place.__str__`). Raises ValueError for anything else."""
    run, dot, n = text.strip().rpartition(".")
    if not dot or not run or not n.isdigit():
        raise ValueError(f"{text!r} is not an event's place (RUN.N, as a frame's id says)")
    return Place(run, int(n))


def run_key(header: LogHeader, index: int) -> str:
    """What places name a run by: its id, or `run-INDEX` in a log written before runs had ids."""
    return header.run_id if header.run_id is not None else f"run-{index}"


@dataclass(frozen=True)
class EventFilter:
    """Which events a reader wants: of these requests, models and types (None: any). A
    step's plan and its tokens belong to every request they hold."""

    request_ids: frozenset[str] | None = None
    models: frozenset[str] | None = None
    types: frozenset[str] | None = None

    def matches(self, event: Event, header: LogHeader) -> bool:
        if self.types is not None and event.type not in self.types:
            return False
        if self.models is not None and header.model_of(event) not in self.models:
            return False
        if self.request_ids is None:
            return True
        if event.request_id is not None:
            return event.request_id in self.request_ids
        members = getattr(event, "request_ids", ())
        return not self.request_ids.isdisjoint(members)


@dataclass
class Reader:
    """One reader of the feed, as the server sees it: where it is in the server's own run
    (the last place handed to it) and the bytes of the batch it is writing (the server's only
    buffer of it: a reader whose socket is full waits there, its place kept, nothing more)."""

    at: int = 0
    holding: int = 0


class EventFrame(NamedTuple):
    """An event, as one SSE frame whose id is its place."""

    place: Place
    frame: bytes


class RunStarted(NamedTuple):
    """The events that follow are of this run (its header, its key)."""

    key: str
    header: LogHeader
    live: bool  # the server's own run, still being recorded


class Missed(NamedTuple):
    """`num_missed` events after `after` are not coming (None: how many is not known): the
    reader fell behind the ring, or they are in no file. `reason` says which, what to do."""

    after: Place
    num_missed: int | None
    reason: str


class View(NamedTuple):
    """What a picture of the engine now is folded from (`EventFeed.view`)."""

    places: list[int]  # the events kept, oldest first
    tokens_out: dict[str, int]  # request shown -> the `decoding` events in memory that hold it


@dataclass
class PrefixTally:
    """The prefix cache's lookups in the run so far, a fold of every event published: a
    request looks its prompt up at its first step (its first `chunk-prefilled` or
    `image-encoded` event), as the page counts them. Kept here, not read from the metrics:
    those are one model's, count no prompt tokens, and are not what the page folds; and the
    ring soon no longer holds a long run's early events."""

    lookups: int = 0  # requests whose first step ran
    hits: int = 0  # ... that started from a cached prefix
    prompt_tokens: int = 0  # their prompts' tokens
    cached_tokens: int = 0  # ... that came from the cache
    # admitted, no first step yet -> its prompt's tokens (the requests waiting: bounded)
    _waiting: dict[str, int] = field(default_factory=dict, repr=False)

    def apply(self, event: Event) -> None:
        if isinstance(event, Admitted):
            self._waiting[event.request_id] = event.num_prompt_tokens
        elif isinstance(event, ChunkPrefilled | ImageEncoded):
            prompt = self._waiting.pop(event.request_id, None)
            if prompt is not None:
                self.lookups += 1
                self.prompt_tokens += prompt
                if event.num_cached_tokens > 0:
                    self.hits += 1
                    self.cached_tokens += event.num_cached_tokens
        elif isinstance(event, Terminal):
            self._waiting.pop(event.request_id, None)  # ended before its first step

    def counts(self) -> dict[str, int]:
        """The counts as the `caught-up` frame sends them."""
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


class CaughtUp(NamedTuple):
    """A view's catch-up (`EventFeed.follow_view`) ends at `at`: it sent `sent` of the `kept`
    events memory held; every event after `at` follows. `tokens_out`: how many `decoding`
    events in memory held each request it showed (what a fold of them all counts as its
    tokens out: the catch-up sends only some of them). `prefix_cache`: the run's prefix
    lookups up to `at` (`PrefixTally.counts`), every request's, not only those it shows."""

    at: Place
    sent: int
    kept: int
    tokens_out: dict[str, int]
    prefix_cache: dict[str, int]


Item = EventFrame | RunStarted | Missed | CaughtUp


def frame(place: Place, event: Event) -> bytes:
    """The SSE frame of `event` at `place`."""
    exclude = _NO_MODEL if event.model is None else None
    return b"id: %s\ndata: %s\n\n" % (
        str(place).encode(),
        event.model_dump_json(exclude=exclude).encode(),
    )


def as_streamed(event: Event, header: LogHeader) -> Event:
    """`event` as the stream carries it: no prompt token ids, no output token ids where the
    log leaves them out (`LogHeader.log_outputs`)."""
    if type(event) is Admitted and event.prompt_token_ids is not None:
        return event.model_copy(update={"prompt_token_ids": None})
    if not header.log_outputs and type(event) is TokensSampled and event.token_ids is not None:
        return event.model_copy(update={"token_ids": None})
    return event


class EventFeed:
    """The last `capacity` events of the server's run (`header`), for readers that follow
    them; `log_path`: the log file they are also written to (None: memory only), and `flush`
    what makes the writer's events so far readable there.

    One writer: `publish`, on the event loop's thread. With `live` false the feed has no run of
    its own: its readers read the log file (`stepline replay LOG --serve`)."""

    def __init__(
        self,
        header: LogHeader,
        *,
        log_path: str | Path | None = None,
        flush: Callable[[], None] | None = None,
        capacity: int = DEFAULT_CAPACITY,
        live: bool = True,
        run: int | None = None,  # not live: the one run of the file it shows (None: all)
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.header = header
        self.key = header.run_id or "live"
        self.log_path = Path(log_path) if log_path is not None else None
        self.flush = flush
        self.capacity = capacity
        self.live = live
        self.run = run
        self.last = 0  # the place (N) of the last event published
        self._events: list[Any] = [None] * capacity  # event N at N % capacity
        self._frames: list[bytes | None] = [None] * capacity  # its frame, once a reader made it
        self._waiter: anyio.Event | None = None  # set at the next publish (or the close)
        self.closed = False  # the server is stopping: readers end once they have it all
        self._readers: dict[int, Reader] = {}  # id() -> each reader following (`reading`)
        self.prefix = PrefixTally()  # the run's prefix lookups up to `last`

    @classmethod
    def of_log(cls, header: LogHeader, writer: Any, capacity: int = DEFAULT_CAPACITY) -> EventFeed:
        """The feed of the run `header` starts, reading back from `writer`'s log
        (events.log.EventLogWriter; None: from memory alone)."""
        if writer is None:
            return cls(header, capacity=capacity)
        return cls(header, log_path=writer.path, flush=writer.flush, capacity=capacity)

    @property
    def first(self) -> int:
        """The place of the oldest event still in memory (last + 1 when there is none)."""
        return max(1, self.last - self.capacity + 1)

    def publish(self, events: Sequence[Event]) -> None:
        """Keep `events` (in order) for the readers and wake those that wait."""
        header, capacity, prefix = self.header, self.capacity, self.prefix
        for event in events:
            self.last += 1
            at = self.last % capacity
            self._events[at] = as_streamed(event, header)
            self._frames[at] = None
            prefix.apply(event)
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def in_memory(self) -> list[Event]:
        """The events the ring holds, oldest first (as streamed: no prompt ids)."""
        return [self._events[n % self.capacity] for n in range(self.first, self.last + 1)]

    def close(self) -> None:
        """The server is stopping: each reader ends once it has read every event published
        (a client reconnects to the next run: what it missed is in the log file)."""
        self.closed = True
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    async def _published(self) -> None:
        if self._waiter is None:
            self._waiter = anyio.Event()
        await self._waiter.wait()

    def _frame(self, n: int) -> bytes:
        at = n % self.capacity
        made = self._frames[at]
        if made is None:
            made = self._frames[at] = frame(Place(self.key, n), self._events[at])
        return made

    # -- reading -------------------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[Reader]:
        """A reader, among `followers` while the block runs."""
        reader = Reader(at=self.last)
        self._readers[id(reader)] = reader
        try:
            yield reader
        finally:
            del self._readers[id(reader)]

    def followers(self) -> list[Reader]:
        """The readers following now (`reading`)."""
        return list(self._readers.values())

    async def follow(
        self, after: Place | None, wanted: EventFilter = EventFilter(), reader: Reader | None = None
    ) -> AsyncIterator[list[Item]]:
        """The events after `after` that `wanted` takes, in order, a batch at a time, for as
        long as the caller reads: the log file's first (events no longer in memory, or of an
        earlier run), then the ring's as they are published. None: from the oldest event in
        memory (a feed that is not live: from the file's start, and then nothing more).
        `reader` (from `reading`) is told where in the server's run the reader is."""
        if not self.live:
            async for batch in self._from_file(after, wanted):
                if not isinstance(batch, int):
                    yield batch
            await anyio.sleep_forever()
        ours = after is not None and after.run == self.key
        if after is None or (ours and (after.n >= self.first - 1 or self.log_path is None)):
            cursor = self.first - 1 if after is None else min(after.n, self.last)
            yield [RunStarted(self.key, self.header, True)]
        else:
            reached: int | None = None
            async for batch in self._from_file(after, wanted):
                if isinstance(batch, int):
                    reached = batch
                    break
                yield batch
            if reached is None:  # the file holds none of the server's own run
                yield [RunStarted(self.key, self.header, True)]
                reached = min(after.n, self.last) if ours else self.first - 1
            cursor = reached
        async for batch in self._from_ring(cursor, wanted, reader or Reader()):
            yield batch

    async def follow_view(
        self, wanted: EventFilter = EventFilter(), reader: Reader | None = None
    ) -> AsyncIterator[list[Item]]:
        """`follow`, for a reader that draws the state now rather than reads the history: the
        events in memory that `view` picks (and `wanted` takes), then `CaughtUp`, then
        every event published after, as `follow` goes on. A feed that is not live: `follow`
        from the file's start."""
        if not self.live:
            async for batch in self.follow(None, wanted, reader):
                yield batch
            return
        yield [RunStarted(self.key, self.header, True)]
        end, kept, header = self.last, self.last - self.first + 1, self.header
        view, prefix = self.view(), self.prefix.counts()  # both as of `end`
        picked = [
            EventFrame(Place(self.key, n), self._frame(n))
            for n in view.places
            if wanted.matches(self._events[n % self.capacity], header)
        ]  # made at once: the ring may move on while they are written
        for i in range(0, len(picked), MAX_BATCH):
            yield list(picked[i : i + MAX_BATCH])
        yield [CaughtUp(Place(self.key, end), len(picked), kept, view.tokens_out, prefix)]
        async for batch in self._from_ring(end, wanted, reader or Reader()):
            yield batch

    def view(self) -> View:
        """What a picture of the engine now is folded from, of the events in memory (on the
        event loop's thread, which changes them: three passes over the ring, no await).

        The requests shown are those in flight (admitted, not ended) and the last VIEW_ENDED
        that ended. Kept: each of their own events (admitted, chunks, end...); the last
        VIEW_STEPS steps' plans and times, and their tokens that hold a request shown; before
        those steps, only the first plan and the first and last tokens that hold each
        request shown (when it was scheduled, its first token, its last); every event of no
        request and no step (the models')."""
        first, last, capacity, events = self.first, self.last, self.capacity, self._events
        ended: set[str] = set()
        shown: set[str] = set()
        num_ended = num_steps = 0
        since = first  # the place of the oldest of the last VIEW_STEPS steps
        for n in range(last, first - 1, -1):
            event = events[n % capacity]
            kind = event.type
            if kind == "terminal":
                ended.add(event.request_id)
                if num_ended < VIEW_ENDED:
                    num_ended += 1
                    shown.add(event.request_id)
            elif kind == "admitted" and event.request_id not in ended:
                shown.add(event.request_id)
            elif kind == "step" and num_steps < VIEW_STEPS:
                num_steps += 1
                since = n
        places: list[int] = []
        tokens_out = dict.fromkeys(shown, 0)
        scheduled: set[str] = set()  # requests shown whose first plan is kept
        sampled: set[str] = set()  # ... whose first tokens are kept
        latest: dict[str, int] = {}  # request shown -> its latest tokens before `since`
        for n in range(first, last + 1):
            event = events[n % capacity]
            kind = event.type
            if event.request_id is not None:
                if event.request_id in shown:
                    places.append(n)
            elif kind == "decoding":
                held = shown.intersection(event.request_ids)
                for rid in held:
                    tokens_out[rid] += 1
                if not held:
                    continue
                if n >= since or not held <= sampled:
                    places.append(n)
                    sampled |= held
                else:
                    latest.update(dict.fromkeys(held, n))
            elif kind == "step":
                if n >= since:
                    places.append(n)
                elif not (held := shown.intersection(event.request_ids)) <= scheduled:
                    places.append(n)
                    scheduled |= held
            elif kind != "step-finished" or n >= since:
                places.append(n)
        if latest:
            places = sorted(set(places).union(latest.values()))
        return View(places, {rid: n for rid, n in tokens_out.items() if n})

    async def _from_ring(
        self, cursor: int, wanted: EventFilter, reader: Reader
    ) -> AsyncIterator[list[Item]]:
        header = self.header
        while True:
            reader.at = cursor
            if cursor < self.first - 1:
                count = self.first - 1 - cursor
                yield [Missed(Place(self.key, cursor), count, self._why_missed(count))]
                cursor = self.first - 1
            if cursor >= self.last:
                if self.closed:
                    return
                await self._published()
                await anyio.sleep(GATHER_S)
                continue
            end = min(self.last, cursor + MAX_BATCH)
            batch: list[Item] = []
            for n in range(cursor + 1, end + 1):
                if wanted.matches(self._events[n % self.capacity], header):
                    batch.append(EventFrame(Place(self.key, n), self._frame(n)))
            cursor = reader.at = end
            if batch:
                yield batch
            else:
                await anyio.lowlevel.checkpoint()

    def _why_missed(self, count: int) -> str:
        where = (
            f"they are in the event log {self.log_path}: reconnect with Last-Event-ID to read "
            "them from it"
            if self.log_path is not None
            else "the server keeps no event log (--event-log): they are lost"
        )
        return (
            f"this reader fell {count} events behind the {self.capacity} the server keeps in "
            f"memory; {where}"
        )

    async def _from_file(
        self, after: Place | None, wanted: EventFilter
    ) -> AsyncIterator[list[Item] | int]:
        """Batches of the file's events after `after` (None: from its start); once they
        reach the server's own run where the ring holds the rest, the place reached there
        (an int) and nothing more. Ends without one when the file ends first."""
        if self.log_path is None:
            if after is not None:
                yield [Missed(after, None, _lost_run(after))]
            return
        if self.flush is not None:
            await anyio.to_thread.run_sync(self.flush)
        own = self.key if self.live else ""  # a file's runs are never the server's own
        reading = await anyio.to_thread.run_sync(
            _FileRead, self.log_path, after, wanted, self.run, own
        )
        try:
            while True:
                handover = self.first - 1 if self.live else None
                batch = await anyio.to_thread.run_sync(reading.next_batch, handover)
                if batch:
                    yield batch
                if reading.reached is not None:
                    yield reading.reached
                    return
                if reading.done:
                    return
        finally:
            reading.close()


def _lost_run(after: Place) -> str:
    return (
        f"the events after {after} are of an earlier run of the server, which keeps no event "
        "log (--event-log): they are lost; what follows is the server's run from the oldest "
        "event it keeps"
    )


class _FileRead:
    """A reading of the log file from a place on, a batch a call (on a worker thread: one at
    a time), run after run."""

    def __init__(
        self, path: Path, after: Place | None, wanted: EventFilter, run: int | None, own: str
    ):
        from stepline.events.log_reader import read_runs

        self.path = path
        self.own = own  # the server's own run's key ("" for none)
        self.wanted = wanted
        self.done = False
        self.reached: int | None = None  # in the server's own run: where the ring goes on
        runs = read_runs(path)
        if run is not None:
            runs = [r for r in runs if r.index == run]
        keys = [run_key(r.header, r.index) for r in runs]
        start, skip = 0, 0
        self.missing: Missed | None = None
        if after is not None:
            if after.run in keys:
                start, skip = keys.index(after.run), after.n
            else:  # a run the file does not hold: go on with the server's own
                self.missing = Missed(after, None, f"no run {after.run} in {path}")
                start = len(runs)
        self._runs = runs[start:]
        self._keys = keys[start:]
        self._skip = skip
        self._events: Iterator[Any] | None = None
        self._index = -1  # in `_runs`
        self._n = 0  # the place of the last event read in the current run

    def next_batch(self, handover: int | None) -> list[Item]:
        """Up to MAX_BATCH more items; `handover`: where the ring starts in the server's own
        run (reading it stops there)."""
        from stepline.events.log_reader import read_run_events

        own_key = self.own
        batch: list[Item] = []
        if self.missing is not None:
            batch.append(self.missing)
            self.missing = None
        while len(batch) < MAX_BATCH:
            if self._events is None:
                self._index += 1
                if self._index >= len(self._runs):
                    self.done = True
                    return batch
                run = self._runs[self._index]
                key = self._keys[self._index]
                self._n = self._skip if self._index == 0 else 0
                self._events = read_run_events(self.path, run=run.index)
                if self._n:
                    self._skip_events(self._n)
                batch.append(RunStarted(key, run.header, key == own_key))
            key, header = self._keys[self._index], self._runs[self._index].header
            if handover is not None and key == own_key and self._n >= handover:
                self.reached = self._n
                return batch
            item = next(self._events, None)
            if item is None:
                self._events = None
                if key == own_key:  # the file has no more of it yet: the ring has the rest
                    self.reached = self._n
                    return batch
                continue
            self._n += 1
            event = as_streamed(item[1], header)
            if self.wanted.matches(event, header):
                batch.append(EventFrame(Place(key, self._n), frame(Place(key, self._n), event)))
        return batch

    def _skip_events(self, n: int) -> None:
        assert self._events is not None
        for _ in range(n):
            if next(self._events, None) is None:
                break

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()


def run_frame(started: RunStarted) -> bytes:
    """The `run` frame: which run the events that follow are of, and its header (without
    the prompt digests' salt)."""
    body = {
        "run": started.key,
        "live": started.live,
        "header": started.header.model_dump(mode="json", exclude={"salt"}),
    }
    return b"event: run\ndata: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def missed_frame(missed: Missed) -> bytes:
    """The `missed` frame: how many events after which place are not coming, and why."""
    body = {"after": str(missed.after), "missed": missed.num_missed, "reason": missed.reason}
    return b"event: missed\ndata: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def caught_up_frame(caught: CaughtUp) -> bytes:
    """The `caught-up` frame: a view's catch-up ends; its id is where (EventSource resumes
    after it), its data how many of the events in memory it sent, each request's tokens out
    and the run's prefix lookups so far (what the page starts its counters from)."""
    body = {
        "at": str(caught.at),
        "sent": caught.sent,
        "kept": caught.kept,
        "tokens_out": caught.tokens_out,
        "prefix_cache": caught.prefix_cache,
    }
    return b"event: caught-up\nid: %s\ndata: %s\n\n" % (
        str(caught.at).encode(),
        json.dumps(body, separators=(",", ":")).encode(),
    )


def frames(batch: Sequence[Item]) -> bytes:
    """A batch of items as SSE frames."""
    out = []
    for item in batch:
        if isinstance(item, EventFrame):
            out.append(item.frame)
        elif isinstance(item, RunStarted):
            out.append(run_frame(item))
        elif isinstance(item, CaughtUp):
            out.append(caught_up_frame(item))
        else:
            out.append(missed_frame(item))
    return b"".join(out)
