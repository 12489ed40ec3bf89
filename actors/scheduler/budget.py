"""A step's budget: what is left of one step's room while the policy plans it, and the work
it took. Decode rows come first (one token each, oldest first); then each drafting row's
drafts (`try_draft`), then the prompts in their order (`try_prompt` for a chunk of prompt
tokens, `try_encode` for an image's encoder units). Each `try_` takes what fits, or says why
nothing did (`Refused`), as SGLang's `PrefillAdder.add_one_req` answers `AddReqResult`.

The room is tokens (`max_step_tokens`), slots (`max_num_seqs`, for a waiting request to
start), KV (`max_kv_tokens`, counted as the running requests decode: in one batch, every
row padded to the longest), and, with a cost model and decode rows to protect, time: the
step's predicted seconds stay under `step_seconds`. A chunk is min(remaining prompt, tokens
left, long-prefill cap, what the time left holds), cut at image spans; encoder units, which
take no tokens, are as many as keep the step within what a chunk of their prompt's length
would cost (`_as_text`): an image's work per step is a text chunk's. The first prompt in
the order always gets at least one token, and the step's first work at least one encoder
unit, so nothing starves. What sized a chunk is its `ScheduledChunk.limit`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from enum import Enum
from functools import cached_property

from stepline.actors.scheduler.batch_geometry import (
    batch_kv_tokens,
    decode_context,
    kv_length,
    padded_decode_context,
)
from stepline.actors.scheduler.cost_model import StepCost, StepFeatures, decode_runs_apart
from stepline.actors.scheduler.plan import (
    ScheduledChunk,
    ScheduledEncode,
    SchedulerConfig,
    StepPlan,
)
from stepline.actors.scheduler.seats import NO_MOVES, SeatMoves
from stepline.actors.scheduler.spans import cut_at_images, whole_image_at
from stepline.events.fold import RequestState, Status
from stepline.events.models import ChunkLimit, HeldReason

# The least share of a step with decode rows that a prefill chunk's own work gets: its time
# to first token stays within about 1 / MIN_PREFILL_SHARE of its bare prefill time, while
# the decoders wait at most a step of 1 / (1 - MIN_PREFILL_SHARE) times the overheads (5.6x:
# about 0.3-0.4 s on a 2-core CPU with stepline-demo-large, where the decode forward costs
# ~30 ms live and a chunk's forward ~20 ms before any token; within the 100 ms target on a
# machine 3x faster). Measured there (engine_bench.py --sections hol, 3 repeats): 0.75 gave
# a stall of 0.22x mlx-lm's best BatchGenerator's at 1.39x its TTFT, 0.78 0.24x at 1.28x,
# 0.8 0.36x at 1.15x. On SmolLM2-135M in float32 over HTTP (a 2,000-token prompt beside 4
# streams, http_load.py, 3 runs each), against mlx_lm.server --prefill-step-size 512: 0.78
# gave a stall of 0.12-0.13x at 0.96-1.04x its TTFT, 0.82 0.14-0.15x at 0.86-0.97x.
MIN_PREFILL_SHARE = 0.82
# ...and where the overheads are small beside the target, the step is no longer than it takes
# to give the prompt's own work this share of it: a longer step would stall the decoders for
# little gain in time to first token. On the small demos on a 2-core CPU, where a step's
# overheads beside 4 decode rows are ~5 ms, steps of ~35-45 ms rather than 100: measured on
# the hybrid demo over HTTP (a 1,984-token prompt beside 4 streams, http_load.py), the
# streams' longest gap 63-110 ms (6 runs) against 234-339 ms (3 runs), the prompt's first
# token in 580-835 ms against 691-743 ms. Never shorter than SHORTEST_STEP of the target (a
# cost model whose overheads come out near zero would otherwise plan steps of a token or two).
PREFILL_SHARE = 0.85
SHORTEST_STEP = 0.25
# Drafted tokens (actors/scheduler/drafter.py) may make a step whose decode rows alone take longer
# than the target up to this many times as long: a drafting row gains a token for every
# draft kept, and every other row waits that much longer for its one.
DRAFT_STRETCH = 1.5
# An embedding request's chunk is background work nobody watches token by token: it takes no
# `MIN_PREFILL_SHARE` of a stretched step (on SmolLM2 on a busy 2-core CPU, where 4 decode rows
# took 130 ms against the 100 ms target, that floor let its chunks make 0.7-1.3 s steps, the
# streams' longest gap 6x theirs alone); a step with one runs to the target, or where the
# decode rows alone take longer, to this many times their time.
EMBED_STRETCH = 1.5


class Refused(Enum):
    """Why a step's budget did not take a request's work (`try_`'s answer; None: it did)."""

    TOKENS = "budget"  # no token of the step's budget left
    SEQS = "max-num-seqs"  # `max_num_seqs` requests running: a waiting one may not start
    KV = "kv"  # its KV does not fit beside the running requests'
    TIME = "time"  # the step-time target leaves its next chunk or encoder unit no time
    IMAGE = "image"  # its next chunk would end inside an image span that goes whole

    @property
    def reason(self) -> HeldReason:
        """The word the plan records for a request held for it (`StepPlan.held`)."""
        return _HELD[self]


_HELD: dict[Refused, HeldReason] = {
    Refused.TOKENS: "budget",
    Refused.SEQS: "max-num-seqs",
    Refused.KV: "kv",
    Refused.TIME: "time",
    Refused.IMAGE: "image",
}


def step_seconds(overheads: float, max_step_ms: float) -> float:
    """How long a step beside decode rows may take, given its predicted `overheads` (the
    decode rows and a chunk's fixed cost): as long as gives the prompt's own work
    `PREFILL_SHARE` of it, within the target (but not under `SHORTEST_STEP` of it); past
    the target only as far as keeps that share at `MIN_PREFILL_SHARE`."""
    target = max_step_ms / 1e3
    short = max(min(target, overheads / (1 - PREFILL_SHARE)), SHORTEST_STEP * target)
    return max(short, overheads / (1 - MIN_PREFILL_SHARE))


class StepBudget:
    """One step's room and the work planned into it so far. Built with the running requests
    (the decoding ones get their token here); then drafts, then prompts: every draft is
    tried before any prompt (the prompts' time is what the decode rows and drafts leave)."""

    def __init__(
        self,
        config: SchedulerConfig,
        cost: StepCost | None,
        running: Sequence[RequestState],
        parked: Sequence[RequestState] = (),
        resuming: int = 0,
    ) -> None:
        self.config = config
        self.cost = cost
        self.tokens_left = config.max_step_tokens
        self.decodes: list[str] = []  # request ids, one token each
        self.chunks: list[ScheduledChunk] = []  # prefill work, in the order it was taken
        self.encodes: list[ScheduledEncode] = []  # vision-encoder work
        self.units = 0  # the image encoder's units in `encodes`
        self.audio_units = 0  # the audio encoder's units in `encodes` (priced apart)
        # request_id -> tokens scheduled (the decode rows first, then the chunks)
        self.num_scheduled: dict[str, int] = {}
        self.drafts: dict[str, tuple[int, ...]] = {}  # decode row -> the drafts it carries
        # running requests, those started here and the parked ones resuming included
        self.num_running = len(running) + resuming
        self._running = running
        self._parked = parked  # out of their seats, their KV kept (seats.py)
        contexts = []
        for s in running:
            if s.status is Status.DECODING and self.tokens_left > 0:
                self.decodes.append(s.request_id)
                self.num_scheduled[s.request_id] = 1
                self.tokens_left -= 1
                contexts.append(decode_context(s))
        decode_attention = padded_decode_context(contexts, split=config.fused_steps)
        # what the step computes so far, as the cost model sees it
        self.features = StepFeatures(decode_rows=len(self.decodes), decode_context=decode_attention)
        self._decode_only = self.features
        self._embeds_whole = False  # an embedding request's whole prompt is among the chunks
        self._chats = False  # a chunk that is not an embedding request's is among the chunks

    @property
    def is_full(self) -> bool:
        """`max_num_seqs` requests run: no waiting one may start."""
        return self.num_running >= self.config.max_num_seqs

    @property
    def scheduled(self) -> Collection[str]:
        """The requests given work so far (tokens or encoder units)."""
        if not self.encodes:
            return self.num_scheduled
        return {*self.num_scheduled, *(e.request_id for e in self.encodes)}

    # -- drafts ----------------------------------------------------------------------------

    def try_draft(self, s: RequestState, proposed: Sequence[int]) -> Refused | None:
        """Decode row `s`'s drafts `proposed`, cut to the tokens left, to the tokens its
        request may still make, and (with a cost model and a target) to the step's time:
        the target, or where the decode rows alone take longer, `DRAFT_STRETCH` times their
        time. Recorded even when none fit (`StepPlan.drafts` gets ()). Returns what cut them
        (None: the budget cut none)."""
        room = s.params.max_tokens - s.num_output_tokens - 1  # the row's own token first
        wanted = min(len(proposed), room)
        n = max(0, min(wanted, self.tokens_left))
        refused = Refused.TOKENS if n < wanted else None
        context = decode_context(s)
        target = self._draft_target
        if target is not None and n > 0:
            assert self.cost is not None
            while n > 0 and self.cost.predict(self.features.with_drafts(context, n)) > target:
                n, refused = n - 1, Refused.TIME
        rid = s.request_id
        self.drafts[rid] = tuple(proposed[:n])
        if n:
            self.features = self.features.with_drafts(context, n)
            self.num_scheduled[rid] += n
            self.tokens_left -= n
        return refused

    @cached_property
    def _draft_target(self) -> float | None:
        """The seconds drafts may make the step (None: not timed), from the decode rows
        alone: computed at the first draft, before any is added."""
        if self.cost is None or self.config.max_step_ms is None:
            return None
        return max(self.config.max_step_ms / 1e3, DRAFT_STRETCH * self.cost.predict(self.features))

    # -- prompts ---------------------------------------------------------------------------

    def try_prompt(self, s: RequestState, start: int) -> Refused | None:
        """A chunk of request `s`'s prompt from `start` (a waiting one starts with it), as
        long as the room allows (`_chunk_size`); a whole image span that no step would hold
        runs alone as the step's first prompt, past the budget."""
        refused = self._may_start(s)
        if refused is not None:
            return refused
        n, limit = self._chunk_size(s, start)
        if n < 1 and not self.chunks and s.images:
            n, limit = whole_image_at(s, start), "image"  # nothing else runs beside it
        if n < 1:  # no time left, or a span that does not fit: the rest next step
            return _REFUSED_BY.get(limit, Refused.TIME)
        end = start + n
        own = self._own_forward(s, start, n)
        self.features = self._base(s).with_chunk(start, n, own_forward=own)
        self._chats = self._chats or s.params.embed is None
        self.chunks.append(
            ScheduledChunk(
                request_id=s.request_id,
                start=start,
                end=end,
                checkpoints=tuple(c for c in s.checkpoints if start < c <= end),
                is_final=end == s.num_prompt_tokens,
                limit=limit,
            )
        )
        self.num_scheduled[s.request_id] = n
        self.tokens_left -= n
        self._embeds_whole = self._embeds_whole or (own and _is_whole(s, start, n))
        self._started(s)
        return None

    def _base(self, s: RequestState) -> StepFeatures:
        """What the step computes before `s`'s chunk joins it: with the decode rows' forward
        of their own where the first chunk that is not an embedding's joins them (beside
        embedding chunks alone, the decode rows' forward is the step's)."""
        if s.params.embed is not None or self._chats:
            return self.features
        apart = self._beside_chunks.separate_decode
        return replace(self.features, separate_decode=self.features.separate_decode + apart)

    def _own_forward(self, s: RequestState, start: int, n: int) -> bool:
        """Whether `s`'s chunk [start, start + n) runs in a forward of its own: an embedding
        request's does, but a whole prompt joins the step's batch of whole ones
        (`engine/embed.py`) once there is one."""
        if s.params.embed is None:
            return False
        return not (self._embeds_whole and _is_whole(s, start, n))

    def try_encode(self, s: RequestState, image: int, start: int) -> Refused | None:
        """Encoder units for image `image` of request `s`, whose prompt's next chunk starts
        at `start` (a waiting one starts with them): as many as the time left allows."""
        refused = self._may_start(s)
        if refused is not None:
            return refused
        k = self._encode_size(s, image, start)
        if k < 1:
            return Refused.TIME
        done = s.encoded[image]
        cached = start if s.status is Status.WAITING else 0
        self.encodes.append(ScheduledEncode(s.request_id, image, done, done + k, cached))
        if s.images[image].medium == "audio":
            self.audio_units += k
        else:
            self.units += k
        self._started(s)
        return None

    def _may_start(self, s: RequestState) -> Refused | None:
        """Why request `s` may get no work now: no token left; for a waiting one, no slot,
        or its KV does not fit."""
        if self.tokens_left <= 0:
            return Refused.TOKENS
        if s.status is not Status.WAITING:
            return None
        if self.is_full:
            return Refused.SEQS
        max_kv = self.config.max_kv_tokens
        if max_kv is None:
            return None
        fits = batch_kv_tokens([*self._kv_lengths, kv_length(s)], self.config) <= max_kv
        return None if fits else Refused.KV

    def _started(self, s: RequestState) -> None:
        if s.status is Status.WAITING:
            self.num_running += 1
            self._kv_lengths.append(kv_length(s))

    @cached_property
    def _kv_lengths(self) -> list[int]:
        """What the running requests' KV may grow to, those started here included, and the
        parked ones' (kept while they wait for a seat)."""
        return [kv_length(s) for s in (*self._running, *self._parked)]

    def _chunk_size(self, s: RequestState, start: int) -> tuple[int, ChunkLimit]:
        """Tokens for request `s`'s next chunk: the token rules, then the time left, then
        its image spans (whole or not at all); and what limited it: the rule that gave the
        size, the first of prompt-end, budget, long-prefill-cap where they tie, and the time
        ("floor" where the step is stretched past the target, or the chunk is the one token
        the first prompt always gets) or an image only where they cut below those."""
        n, limit = s.num_prompt_tokens - start, "prompt-end"
        if self.tokens_left < n:
            n, limit = self.tokens_left, "budget"
        cap = self.config.long_prefill_cap
        if cap is not None and cap < n:
            n, limit = cap, "long-prefill-cap"
        if self._seconds is not None and n > 0:
            assert self.cost is not None
            base = self._base(s)
            embedding = s.params.embed is not None
            seconds = min(self._seconds, self._embed_seconds) if embedding else self._seconds
            left = seconds - self.cost.predict(self._encoding(base))
            fits = self.cost.max_chunk_tokens(start, left)
            if embedding and (self._own_forward(s, start, n) or fits < n):
                # its forward of its own, priced before its tokens (a cut chunk is not whole)
                left -= self.cost.per_separate_decode
                fits = self.cost.max_chunk_tokens(start, left)
            if fits < n:
                n, limit = fits, (self._over_time if seconds == self._seconds else "time")
            if not self.chunks and n < 1:
                n, limit = 1, "floor"  # the first prompt in the order always moves
        if s.images and n > 0:
            cut = cut_at_images(s, start, n)
            if cut < n:
                n, limit = cut, "image"
        if s.params.embed is not None and s.params.embed.whole:
            n, limit = self._whole(s, start, n, limit)
        return n, limit

    def _whole(
        self, s: RequestState, start: int, n: int, limit: ChunkLimit
    ) -> tuple[int, ChunkLimit]:
        """A prompt that goes in one chunk (`EmbedParams.whole`, a non-causal model's): all of
        it, or none this step (`limit`: what cut it); as the step's first prompt it runs whole
        past the budget or the time target, as a whole image span no step holds does."""
        rest = s.num_prompt_tokens - start
        if n >= rest:
            return n, limit
        if not self.chunks:
            return rest, "prompt-end"
        return 0, limit

    def _encode_size(self, s: RequestState, i: int, start: int) -> int:
        """Encoder units for image `i` of request `s` (its prompt's next chunk at `start`):
        what is left, then the time a text prompt of its length would take (`_as_text`);
        the step's first work always moves (nothing starves)."""
        k = s.images[i].units - s.encoded[i]
        if self._seconds is not None:
            assert self.cost is not None
            left = self._as_text(s, start) - self.cost.predict(self._encoding(self.features))
            # an encoder not priced yet runs a unit a step until the model has its measure
            price = self.cost.per_unit(s.images[i].medium)
            k = min(k, max(0, int(left / price)) if price > 0 else 1)
            if not self.chunks and not self.encodes:
                k = max(k, 1)
        return k

    def _as_text(self, s: RequestState, start: int) -> float:
        """The seconds this step would take with a text prompt of request `s`'s length as its
        next chunk: the tokens `s` computes (its prompt less its cache hit, from its first
        computed token), cut by the tokens left, the long-prefill cap and the step's time.
        Its encoder units get that time, not all of `_seconds`: they are work its tokens do
        not count, and packed to the step's time a short prompt's image made steps 2-3x as
        long as its text's one chunk; so its encoder takes more steps, not the streams."""
        assert self.cost is not None and self._seconds is not None
        first = start if s.status is Status.WAITING else s.num_cached_tokens
        n = min(s.num_prompt_tokens - first, self.tokens_left)
        cap = self.config.long_prefill_cap
        if cap is not None:
            n = min(n, cap)
        base = self._encoding(self._base(s))
        n = min(n, self.cost.max_chunk_tokens(first, self._seconds - self.cost.predict(base)))
        return self.cost.predict(base.with_chunk(first, max(n, 0)))

    def _encoding(self, features: StepFeatures) -> StepFeatures:
        """`features` plus the encoder units taken so far, each medium's priced as its own."""
        return features.with_encode(self.units).with_encode(self.audio_units, "audio")

    # -- the time the prompts get (fixed once the decode rows and drafts are in) ------------

    @cached_property
    def _beside_chunks(self) -> StepFeatures:
        """The decode rows once a chunk joins them: plus their forward of their own, or not
        (drafting rows run in the chunks' forward as a prompt's chunk does)."""
        prefilling = bool(self.drafts) or any(s.status is Status.PREFILLING for s in self._running)
        apart = bool(self.decodes) and decode_runs_apart(
            fused_steps=self.config.fused_steps, prefilling=prefilling
        )
        d = self._decode_only
        return StepFeatures(
            decode_rows=d.decode_rows, decode_context=d.decode_context, separate_decode=int(apart)
        )

    @cached_property
    def _seconds(self) -> float | None:
        """How long the step may take (`step_seconds`); None: not timed (no cost model, no
        target, or no decode rows to protect)."""
        max_step_ms = self.config.max_step_ms
        if self.cost is None or max_step_ms is None or not self.decodes:
            return None
        return step_seconds(
            self.cost.predict(self._beside_chunks) + self.cost.per_chunk, max_step_ms
        )

    @cached_property
    def _embed_seconds(self) -> float:
        """How long a step with an embedding request's chunk may take (`EMBED_STRETCH`)."""
        assert self.cost is not None and self.config.max_step_ms is not None
        decode = self.cost.predict(self._decode_only)
        return max(self.config.max_step_ms / 1e3, EMBED_STRETCH * decode)

    @property
    def _over_time(self) -> ChunkLimit:
        """What a chunk the time left cuts is limited by: "floor" where the step is
        stretched past the target to its floor."""
        max_step_ms = self.config.max_step_ms
        assert self._seconds is not None and max_step_ms is not None
        return "floor" if self._seconds > max_step_ms / 1e3 else "time"

    # -- the plan --------------------------------------------------------------------------

    def plan(
        self,
        step: int,
        held: tuple[tuple[str, HeldReason], ...],
        seats: SeatMoves = NO_MOVES,
    ) -> StepPlan:
        """Step `step`'s plan of the work taken, with the requests `held` out of it and the
        `seats` that change (after the step: a request parks after a step it decodes in)."""
        decodes = set(self.decodes)
        features = self._encoding(self.features)
        return StepPlan(
            step=step,
            decodes=tuple(self.decodes),
            chunks=tuple(self.chunks),
            encodes=tuple(self.encodes),
            num_scheduled_tokens=self.num_scheduled,
            features=features,
            predicted_seconds=self.cost.predict(features) if self.cost is not None else None,
            held=held,
            drafts=self.drafts,
            parks=tuple(rid for rid in seats.parks if rid in decodes),
            resumes=seats.resumes,
        )


# What a chunk cut to nothing was cut by -> why its request sat the step out.
_REFUSED_BY: dict[ChunkLimit, Refused] = {
    "image": Refused.IMAGE,
    "budget": Refused.TOKENS,
    "long-prefill-cap": Refused.TOKENS,
}


def _is_whole(s: RequestState, start: int, n: int) -> bool:
    """Whether the chunk [start, start + n) is `s`'s whole prompt, with no checkpoint in it."""
    return start == 0 and n == s.num_prompt_tokens and not s.checkpoints
