"""Requests, as the summary counts them: how each ended, its latencies, and the ones a run
left unfinished, the engine's own requests (next turns) apart from the clients' (`Requests`);
and their tokens: prompt tokens admitted, those the prefix cache served, those prompt chunks
computed, tokens sampled, and why prefix-cache hits stopped short (`TokenTotals`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from stepline.events.fold import Status
from stepline.events.models import Admitted, ChunkPrefilled, ImageEncoded, Terminal
from stepline.events.replay.describe import InFlight
from stepline.events.replay.stalls import DecodingRows
from stepline.events.replay.stats import Distribution, Report


class NextTurns(Report):
    """The engine's own prefills of chats' next turns (api/pipeline/next_turn.py): how many,
    how they ended (a client's request needing the seat cancels one), the prompt tokens they
    computed. Counted in the summary's token totals; left out of its requests, outcomes,
    latency percentiles and prefix misses (a client waits for none of them)."""

    num_requests: int
    outcomes: dict[str, int]
    num_prefilled_tokens: int


@dataclass(slots=True)
class Track:
    """A request of the run being read, from its admission to its terminal."""

    num_prompt_tokens: int
    num_computed: int
    admitted_step: int
    admitted_ts: float
    first_scheduled_ts: float | None = None
    chunked: bool = False
    ours: bool = False  # the engine's own (`Admitted.origin`)

    def status(self) -> Status:
        if self.num_computed >= self.num_prompt_tokens:
            return Status.DECODING
        return Status.PREFILLING if self.chunked else Status.WAITING


class Requests:
    """Outcomes (finish reason -> requests, per run and in total), the clients' latencies
    (queueing, time to first token, end to end), and the requests each run left unfinished:
    `interrupted` by a restart, `in_flight` when the log ends. The engine's own requests
    are tracked like a client's but counted apart (`next_turns`)."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.ttft, self.queueing, self.e2e = (Distribution() for _ in range(3))
        self.ours_outcomes: Counter[str] = Counter()
        self.ours_prefilled = 0
        self.interrupted: list[InFlight] = []
        self.in_flight: list[InFlight] = []
        self.start_run()

    def start_run(self) -> None:
        self.tracks: dict[str, Track] = {}
        self.run_outcomes: Counter[str] = Counter()

    def admitted(self, event: Admitted) -> bool:
        """Track the request; False for one tracked already (a second `admitted`)."""
        if event.request_id in self.tracks:
            return False
        self.tracks[event.request_id] = Track(
            num_prompt_tokens=event.num_prompt_tokens,
            num_computed=event.num_cached_tokens,
            admitted_step=event.step,
            admitted_ts=event.ts,
            ours=getattr(event, "origin", "client") != "client",
        )
        return True

    def scheduled(self, ids: Iterable[str], ts: float) -> None:
        """`ids` had prompt work in a step planned at `ts`: a first one ends their queueing."""
        tracks = self.tracks
        for rid in ids:
            t = tracks.get(rid)
            if t is not None and t.first_scheduled_ts is None:
                t.first_scheduled_ts = ts
                if not t.ours:
                    self.queueing.add(ts - t.admitted_ts)

    def chunk(self, event: ChunkPrefilled) -> bool:
        """Note a prompt chunk; True where it is the engine's own request's."""
        t = self.tracks.get(event.request_id)
        if t is None:
            return False
        if t.ours:
            self.ours_prefilled += event.end - event.start
        t.num_computed = max(t.num_computed, event.end)
        t.chunked = True
        return t.ours

    def encoded(self, event: ImageEncoded) -> None:
        t = self.tracks.get(event.request_id)
        if t is not None:
            t.num_computed = max(t.num_computed, event.num_cached_tokens)
            t.chunked = True

    def first_tokens(self, ids: Iterable[str], ts: float) -> None:
        """`ids` sampled their first token at `ts`."""
        tracks = self.tracks
        for rid in ids:
            t = tracks.get(rid)
            if t is not None and not t.ours:
                self.ttft.add(ts - t.admitted_ts)

    def terminal(self, event: Terminal) -> None:
        t = self.tracks.pop(event.request_id, None)
        if t is None:
            if event.status is not None:  # refused at a door: never admitted
                self.run_outcomes[str(event.reason)] += 1
            return  # else a second terminal, or an unknown request: verify's business
        if t.ours:
            self.ours_outcomes[str(event.reason)] += 1
        else:
            self.run_outcomes[str(event.reason)] += 1
            self.e2e.add(event.ts - t.admitted_ts)

    def end_run(self, run: int, rows: DecodingRows, *, last: bool) -> Counter[str]:
        """Close run `run` (`last`: the log ends with it): its unfinished requests (their
        tokens as `rows` counted them) are in flight or interrupted. Returns its outcomes."""
        left = [
            InFlight(
                request_id=rid,
                status=t.status(),
                num_prompt_tokens=t.num_prompt_tokens,
                num_computed_tokens=t.num_computed,
                num_output_tokens=rows.num_tokens(rid),
                admitted_step=t.admitted_step,
                run=run,
            )
            for rid, t in self.tracks.items()
        ]
        (self.in_flight if last else self.interrupted).extend(left)
        if left:
            self.run_outcomes["in-flight" if last else "interrupted"] += len(left)
        self.outcomes.update(self.run_outcomes)
        return self.run_outcomes

    def next_turns(self) -> NextTurns | None:
        """The engine's own requests' figures (None: it sent none)."""
        if not self.ours_outcomes:
            return None
        return NextTurns(
            num_requests=sum(self.ours_outcomes.values()),
            outcomes=dict(self.ours_outcomes.most_common()),
            num_prefilled_tokens=self.ours_prefilled,
        )


class TokenTotals:
    """Counts every request's tokens, the engine's own included; misses only the clients'."""

    def __init__(self) -> None:
        self.num_prompt = self.num_cached = self.num_prefilled = self.num_output = 0
        # `events.models.PrefixMiss` -> requests (schema 8 on, with a prefix cache)
        self.prefix_misses: Counter[str] = Counter()

    def admitted(self, event: Admitted) -> None:
        self.num_prompt += event.num_prompt_tokens
        self.num_cached += event.num_cached_tokens

    def chunk(self, event: ChunkPrefilled, *, ours: bool) -> None:
        """A prompt chunk (`ours`: of the engine's own request)."""
        if not ours and event.prefix_miss is not None:
            self.prefix_misses[event.prefix_miss] += 1
        self.num_prefilled += event.end - event.start
        self.num_cached += event.num_cached_tokens  # the first chunk says what it reused

    def encoded(self, event: ImageEncoded) -> None:
        if event.prefix_miss is not None:
            self.prefix_misses[event.prefix_miss] += 1
        self.num_cached += event.num_cached_tokens  # the first step says what it reused

    def sampled(self, num_tokens: int) -> None:
        self.num_output += num_tokens
