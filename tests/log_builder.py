"""Hand-made event logs for the replay tests: exact timings and shapes (broken ones too, for
`verify`) that no engine run gives, written through the real writer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from stepline.events.log import EventLogWriter
from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    FinishReason,
    LogHeader,
    RequestParams,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
    prompt_digest,
)

T0 = 1000.0
PARAMS = RequestParams(max_tokens=3, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)
TOKEN = 7  # what `do_step` samples


class LogBuilder:
    """Records events the way the step loop does: numbered in order, stamped with the
    builder's clock `ts` and its step (the last one planned, for events between steps).

    A step is planned at `ts` (with `step_every`, at t0 + step * step_every instead); the
    executor takes `seconds` (a step-finished event where the log is `timed`); its results
    come then; `do_step` then lets `loop_seconds` pass before the next.
    """

    def __init__(
        self,
        t0: float = T0,
        *,
        max_step_tokens: int = 8,
        max_num_seqs: int = 4,
        params: RequestParams = PARAMS,
        timed: bool = False,
        step_every: float | None = None,
        loop_seconds: float = 0.0,
        model_name: str | None = None,  # the model every event names (a log models share)
        max_step_ms: float | None = None,  # the step-time target the header's config names
        **header,  # LogHeader fields: log_prompts, run_id, salt, ...
    ) -> None:
        self.t0 = self.ts = t0
        self.step = 0
        self.events: list = []
        self.max_step_tokens, self.max_num_seqs = max_step_tokens, max_num_seqs
        self.params, self.timed = params, timed
        self.step_every, self.loop_seconds = step_every, loop_seconds
        self.prompts: dict[str, int] = {}  # request id -> its prompt's length
        self.model_name = model_name
        config = {
            "max_step_tokens": max_step_tokens,
            "max_num_seqs": max_num_seqs,
            "long_prefill_cap": None,
            **({"max_step_ms": max_step_ms} if max_step_ms is not None else {}),
        }
        self.header = LogHeader(created=t0, model="demo", config=config, **header)

    def _add(self, cls, **fields):
        event = cls(
            seq=len(self.events) + 1, ts=self.ts, step=self.step, model=self.model_name, **fields
        )
        self.events.append(event)
        return event

    def model_event(self, cls, **fields) -> None:
        """An event of the model's own (`ModelLoaded`, `ModelLoadFailed`, `ModelUnloaded`),
        between steps as the step loop records it."""
        self._add(cls, **fields)

    def admit(
        self,
        rid: str,
        n: int,
        *,
        params: RequestParams | None = None,
        checkpoints: Iterable[int] = (),
        cached: int = 0,  # a cache hit recorded on admission, as logs of schema 1 did
    ) -> None:
        ids = tuple(range(n))
        self.prompts[rid] = n
        self._add(
            Admitted,
            request_id=rid,
            num_prompt_tokens=n,
            prompt_token_ids=ids,  # the writer leaves them out if the header says so
            prompt_sha256=prompt_digest(self.header.salt, ids),
            checkpoints=tuple(checkpoints),
            num_cached_tokens=cached,
            cache_source="memory" if cached else None,
            params=params or self.params,
        )

    def plan(
        self,
        *entries: tuple[str, str, int],
        seconds: float = 0.05,
        predicted: float | None = None,
        limits: tuple[str | None, ...] = (),
        held: Mapping[str, str] | None = None,
    ) -> None:
        """Start the next step with (request id, kind, tokens) entries (`limits`: what sized
        each; `held`: requests that sat it out -> why); the executor takes `seconds`. Its
        results (`chunk`, `token`, ...) follow."""
        self.step += 1
        if self.step_every is not None:
            self.ts = self.t0 + self.step * self.step_every
        self._add(
            StepPlanned,
            request_ids=tuple(r for r, _, _ in entries),
            num_tokens=tuple(n for _, _, n in entries),
            kinds=tuple(k for _, k, _ in entries),
            max_step_tokens=self.max_step_tokens,
            max_num_seqs=self.max_num_seqs,
            limits=limits,
            held_ids=tuple(held or {}),
            held_reasons=tuple((held or {}).values()),
        )
        self.ts += seconds
        if self.timed:
            self._add(StepFinished, seconds=seconds, predicted_seconds=predicted)

    def do_step(
        self,
        decode: Iterable[str] = (),
        prefill: Mapping[str, tuple[int, int]] | None = None,
        *,
        seconds: float = 0.05,
        predicted: float | None = None,
        idle: float = 0.0,
    ) -> None:
        """A whole step: a decode row for each of `decode`, a chunk [start, end) for each of
        `prefill` (a prompt's last one samples its first token), each token `TOKEN`; then
        `loop_seconds` and `idle` pass."""
        decode, prefill = list(decode), prefill or {}
        self.plan(
            *((r, "decode", 1) for r in decode),
            *((r, "prefill", end - start) for r, (start, end) in prefill.items()),
            seconds=seconds,
            predicted=predicted,
        )
        sampled = []
        for rid, (start, end) in prefill.items():
            self.chunk(rid, start, end)
            if end == self.prompts[rid]:
                sampled.append(rid)
        self.tokens(*sampled, *decode)
        self.ts += self.loop_seconds + idle

    def chunk(self, rid: str, start: int, end: int) -> None:
        self._add(ChunkPrefilled, request_id=rid, start=start, end=end)

    def checkpoint(self, rid: str, offset: int) -> None:
        self._add(CheckpointReached, request_id=rid, offset=offset)

    def token(self, rid: str, token: int = TOKEN) -> None:
        self._add(TokensSampled, request_ids=(rid,), token_ids=(token,))

    def tokens(self, *rids: str) -> None:
        """One step's tokens, `TOKEN` for each of `rids` (no event if there are none)."""
        if rids:
            self._add(TokensSampled, request_ids=rids, token_ids=(TOKEN,) * len(rids))

    def end(self, rid: str, reason: FinishReason, message: str | None = None) -> None:
        self._add(Terminal, request_id=rid, reason=reason, message=message)

    def refuse(self, rid: str, code: str = "invalid_value", status: int = 400) -> None:
        """A request refused at a door: a lone terminal, as the HTTP server records it."""
        message = f"refused: {code}"
        self._add(
            Terminal,
            request_id=rid,
            reason=FinishReason.REJECTED,
            message=message,
            code=code,
            status=status,
        )

    def write(self, path: Path, events: Iterable | None = None, *, append: bool = False) -> Path:
        """Write this log (or `events` under its header) to `path`: a new file, or appended
        as a run of its own."""
        with EventLogWriter(path, self.header, append=append, overwrite=not append) as writer:
            for event in self.events if events is None else events:
                writer.append(event)
        return path
