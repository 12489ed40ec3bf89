"""The scheduling policy: a pure function from scheduling state to one step's plan.

No MLX, no I/O, no clock. Per step, within `max_step_tokens` and `max_num_seqs`:
1. every decoding request gets one token (oldest first, if the budget is short);
2. prompts get what is left, mid-prefill or waiting alike, shortest prompt left first (what
   is left of it after its cached prefix), so that a burst of requests, or a chat arriving
   while a long prompt prefills, gets its first token early; but a prompt that has not
   moved for `MAX_WAIT_STEPS` steps (since it was admitted, or since its last chunk) goes
   before every other (oldest first among those), so a long prompt is held back for a
   bounded number of steps, never forever. A waiting
   request starts only if its KV fits (counted as the running requests decode: in one
   batch, every row padded to the longest).
A chunk is min(remaining prompt, budget left, long-prefill cap).

Fair share between clients (`RequestState.client`: an API key and `user`, over HTTP). A
client's share is `max_num_seqs` / the clients with live requests. While more than one
client waits, a waiting request whose client would already run its share when it starts
goes after every other prompt (`fair_order`): one client's hundreds of requests, aged or
not, do not keep another's chat from the next free slot. The held ones go the client with
fewer running first, then in the order above. With one client waiting, the order is
exactly the one above. Nothing running is stopped for it: a client's share is taken back as
its requests end. A client may also fill at most three quarters of the waiting queue
(`SchedulerConfig.max_waiting_per_client`): the rest is kept for others.

With a cost model (`StepCost`, fitted by actors/scheduler/cost_model.py) and decode rows to protect,
chunks are also sized so that the step's predicted time stays under `max_step_ms`: they
shrink as their context grows and as decode rows are added. The first prompt in the order
always gets at least one token, so nothing starves. Within the target a step is no longer
than it takes to give the prompt's own work PREFILL_SHARE of it (where the overheads, the
decode rows and a chunk's fixed cost, are small, a longer step stalls the decoders for
little gain), and it is never so short that the overheads take more than
1 - MIN_PREFILL_SHARE of it: on a machine where they are large beside the target, the step
stretches so that the prompt's own work keeps most of it (every step pays the overheads,
and a prompt cut into many small chunks would wait far longer for its first token than it
takes to compute). `step_seconds` says how long a step may be.
With nobody decoding there is nobody to protect: a lone prompt prefills in chunks as big
as the token rules allow.

Images (`RequestState.images`, a vision model's prompts). A prompt that reaches an image
whose encoder work is not done gets encoder units next, not tokens: as many as the time
left allows (priced `per_encode_unit`; at least one for a step's first work, so an encoder
dearer than the target still moves; all of them without a cost model). No chunk reaches
into an image before its units are done. Then its tokens are chunked as text, or, for an
image that goes `whole`, in one chunk: cut before it when it does not fit what is left of
the step, and run alone, past the budget, by the step's first prompt when no step would
hold it.

A plan says why it is what it is: what sized each chunk (`ScheduledChunk.limit`, from
`chunk_size`) and which requests sat the step out and why (`StepPlan.held`: held.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from operator import attrgetter

from stepline.actors.scheduler.cost_model import StepCost, StepFeatures, decode_runs_apart
from stepline.actors.scheduler.held import oldest_held
from stepline.actors.scheduler.prefix_index import Candidate, PrefixPlan
from stepline.actors.scheduler.spans import inside_image
from stepline.events.fold import RequestState, Status
from stepline.events.models import ChunkLimit, HeldReason

# A step every 100 ms is 10 tokens/s for every stream while a long prompt prefills: still
# faster than anyone reads, and long enough that a chunk's fixed cost (a forward call, the
# step's own overhead) stays small beside its work, so prompts are not slowed much.
DEFAULT_MAX_STEP_MS = 100.0
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
# Prompts go shortest first; one that has not moved for this many steps goes before every
# other. A burst of 16 chats of 32-512 tokens on stepline-demo:
# its median time to first token was about 0.8x that of admitting oldest first.
MAX_WAIT_STEPS = 8


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 32  # most requests running (prefilling or decoding) at once
    long_prefill_cap: int | None = None  # most prompt tokens one request gets per step
    max_kv_tokens: int | None = None  # KV capacity in tokens; None = unbounded
    # fixed KV cost of each running request (recurrent state, the room its KV buffer grows
    # by: engine.memory.KVFootprint.tokens_per_seq), in units of one token's KV
    kv_tokens_per_seq: int = 0
    kv_bytes_per_token: int = 0  # one token's KV in bytes, for messages (0 = not measured)
    max_waiting: int = 1024  # most requests waiting for their first chunk; beyond: QueueFullError
    # target time of a step with decode rows, given a cost model; None = tokens only
    max_step_ms: float | None = DEFAULT_MAX_STEP_MS
    # the executor runs a step's decode rows inside its chunks' forward (engine/fused.py)
    fused_steps: bool = False

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > self.max_step_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_step_tokens "
                f"({self.max_step_tokens}): every running request decodes one token every step"
            )
        if self.long_prefill_cap is not None and self.long_prefill_cap < 1:
            raise ValueError(f"long_prefill_cap must be >= 1, got {self.long_prefill_cap}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {self.max_kv_tokens}")
        if self.kv_tokens_per_seq < 0 or self.kv_bytes_per_token < 0:
            raise ValueError("kv_tokens_per_seq and kv_bytes_per_token must be >= 0")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0 (or None), got {self.max_step_ms}")

    @property
    def chunk_cap(self) -> int:
        return self.long_prefill_cap or self.max_step_tokens

    @property
    def max_waiting_per_client(self) -> int:
        """Most requests one client may have waiting: the last quarter of the queue is kept
        for the others (none is, in a queue of 3 or fewer)."""
        return self.max_waiting - self.max_waiting // 4


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int  # first prompt position computed in this step
    end: int  # one past the last
    checkpoints: tuple[int, ...]  # checkpoint offsets in (start, end]: snapshot there
    is_final: bool  # end == prompt length: logits of the last position are sampled
    # what sized it (`schedule`'s word: see `chunk_size` there); None: made by hand
    limit: ChunkLimit | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ScheduledEncode:
    """Vision-encoder work for one image of a request's prompt: units [start, end)."""

    request_id: str
    image: int  # which of the prompt's images (prompt order)
    start: int
    end: int
    cached: int = 0  # a request's first step: the prompt tokens its cache hit serves

    @property
    def num_units(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepPlan:
    step: int
    decodes: tuple[str, ...] = ()  # request ids, one token each
    chunks: tuple[ScheduledChunk, ...] = ()  # prefill work, in scheduling order
    encodes: tuple[ScheduledEncode, ...] = ()  # vision-encoder work (no tokens)
    # request_id -> tokens scheduled (the decode rows first, then the chunks); decodes count 1
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    features: StepFeatures = StepFeatures()  # what the step computes, as the cost model sees it
    predicted_seconds: float | None = None  # the cost model's prediction; None without one
    # (request_id, why) of the oldest requests that could have joined and did not: at most
    # MAX_HELD, oldest first (actors/scheduler/held.py)
    held: tuple[tuple[str, HeldReason], ...] = ()
    # request_id -> the drafted tokens its decode row carries (actors/scheduler/drafter.py), for
    # every decode row that drafts (() where none were found or fit this step): the executor
    # runs those with drafts, and those already drafting, against their own caches
    # (`Drafter.planned`); its scheduled tokens count them
    drafts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.chunks and not self.encodes


def kv_length(state: RequestState) -> int:
    """Tokens a request's KV may grow to: its prompt plus every token it may generate."""
    return state.num_prompt_tokens + state.params.max_tokens


def batch_kv_tokens(lengths: Sequence[int], config: SchedulerConfig) -> int:
    """KV, in tokens, of requests whose KV may grow to `lengths` once they decode together:
    mlx-lm's batch cache (`BatchKVCache`) left-pads every row to the longest, so each row
    takes the longest one's room, plus its fixed per-request state. (Counted per request,
    16 short chats beside one 2,000-token prompt took 11x the KV memory they were counted
    for.)"""
    return len(lengths) * (max(lengths, default=0) + config.kv_tokens_per_seq)


def _chunk(state: RequestState, num_tokens: int, start: int, limit: ChunkLimit) -> ScheduledChunk:
    end = start + num_tokens
    return ScheduledChunk(
        request_id=state.request_id,
        start=start,
        end=end,
        checkpoints=tuple(c for c in state.checkpoints if start < c <= end),
        is_final=end == state.num_prompt_tokens,
        limit=limit,
    )


def pending_image(state: RequestState, start: int) -> int | None:
    """The first of the request's images, from prompt position `start` on, whose encoder
    work is not all done (its index), or None."""
    for i, image in enumerate(state.images):
        if image.end > start and state.encoded[i] < image.units:
            return i
    return None


def cut_at_images(state: RequestState, start: int, n: int) -> int:
    """A chunk of at most `n` tokens at `start`, cut so that it stops before any image span
    not yet encoded, and never ends inside a span that goes whole; 0: the span at `start`
    goes whole and does not fit."""
    end = start + n
    for i, image in enumerate(state.images):
        if image.start >= end or image.end <= start:
            continue
        if state.encoded[i] < image.units or (image.whole and end < image.end):
            end = max(image.start, start)
            break
    return end - start


def whole_image_at(state: RequestState, start: int) -> int:
    """Tokens of the span of a whole image starting at `start` (0: none does). The first
    prompt of a step whose whole span fits no step's room runs it alone, past the budget or
    the time target, rather than never (the log's `chunk-prefilled` says so)."""
    for image in state.images:
        if image.whole and image.start == start:
            return image.end - image.start
    return 0


def decode_context(state: RequestState) -> int:
    """Tokens a decoding request's next token attends to."""
    return state.num_prompt_tokens + state.num_output_tokens


# Where steps fuse (`engine/decode_groups.py`), a row joining the decode batch starts a
# group of its own if joining the group it pads least would add more padded keys than this
# to every step (on SmolLM2 ~12 us of CPU attention a key-row, against a few ms a step for
# one more group's ops)...
SPLIT_KEYS = 1024
# ... and there are fewer groups than this.
MAX_GROUPS = 4


def place_row(groups: Sequence[tuple[int, int]], length: int, split: bool) -> int | None:
    """The decode group a row of `length` keys joins, given each group's (rows, padded
    length): the one it pads least; None for a group of its own (only where `split`)."""
    best, added = None, 0
    for i, (rows, padded) in enumerate(groups):
        more = (rows + 1) * max(padded, length) - rows * padded - length
        if best is None or more < added:
            best, added = i, more
    if best is None or (split and added > SPLIT_KEYS and len(groups) < MAX_GROUPS):
        return None
    return best


def place_rows(
    groups: Sequence[tuple[int, int]], lengths: Sequence[int], split: bool
) -> tuple[list[tuple[int, int]], list[int]]:
    """Rows of `lengths` keys joining decode groups of (rows, padded length), in order, each
    where `place_row` puts it: the groups after, and the group each row went to."""
    after, where = list(groups), []
    for n in lengths:
        i = place_row(after, n, split)
        if i is None:
            i = len(after)
            after.append((0, 0))
        rows, padded = after[i]
        after[i] = (rows + 1, max(padded, n))
        where.append(i)
    return after, where


def step_seconds(overheads: float, max_step_ms: float) -> float:
    """How long a step beside decode rows may take, given its predicted `overheads` (the
    decode rows and a chunk's fixed cost): as long as gives the prompt's own work
    `PREFILL_SHARE` of it, within the target (but not under `SHORTEST_STEP` of it); past
    the target only as far as keeps that share at `MIN_PREFILL_SHARE`."""
    target = max_step_ms / 1e3
    short = max(min(target, overheads / (1 - PREFILL_SHARE)), SHORTEST_STEP * target)
    return max(short, overheads / (1 - MIN_PREFILL_SHARE))


def padded_decode_context(contexts: Sequence[int], split: bool = False) -> int:
    """The attention work of decode rows with these contexts, in the order they joined the
    batch: mlx-lm's batch cache (`BatchKVCache`) left-pads every row to the longest of its
    group, and attention runs over the padding too; rows go in groups as `place_row` puts
    them (one group unless `split`). (Summed per row, 31 short chats beside one 4,000-token
    request were priced at a tenth of their decode step: stepline-demo-large under Poisson
    arrivals measured 2-3 s decode steps predicted at 0.5 s, and every stream stalled on
    them.)"""
    groups, _ = place_rows([], contexts, split)
    return sum(rows * padded for rows, padded in groups)


_arrival = attrgetter("admitted_seq")
_RUNNING = (Status.PREFILLING, Status.DECODING)


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
    for a prefix another request is computing (`engine.prefix_index.plan_prefixes`).
    `drafts`: the tokens each drafting request proposes (`actors/scheduler/drafter.py`); they get
    what the budget and the time leave after every decode row's token, before any prompt.
    """
    prefix = prefix or PrefixPlan()
    live = sorted((s for s in states.values() if not s.is_finished), key=_arrival)
    budget = config.max_step_tokens
    decodes: list[str] = []
    chunks: list[ScheduledChunk] = []
    encodes: list[ScheduledEncode] = []
    units = 0  # the encoder units in `encodes`
    num_scheduled: dict[str, int] = {}

    running = [s for s in live if s.status in _RUNNING]
    contexts: list[int] = []
    for s in running:
        if s.status is Status.DECODING and budget > 0:
            decodes.append(s.request_id)
            num_scheduled[s.request_id] = 1
            budget -= 1
            contexts.append(decode_context(s))
    decode_rows = len(decodes)
    decode_attention = padded_decode_context(contexts, split=config.fused_steps)
    features = StepFeatures(decode_rows=decode_rows, decode_context=decode_attention)
    drafted: dict[str, tuple[int, ...]] = {}
    if drafts:
        budget, features = _fit_drafts(
            drafts, states, decodes, budget, features, config, cost, num_scheduled, drafted
        )
    # The decode rows once a chunk joins them: plus their forward of their own, or not
    # (drafting rows run in the chunks' forward as a prompt's chunk does).
    prefilling = bool(drafted) or any(s.status is Status.PREFILLING for s in running)
    apart = bool(decodes) and decode_runs_apart(
        fused_steps=config.fused_steps, prefilling=prefilling
    )
    beside_chunks = StepFeatures(
        decode_rows=decode_rows, decode_context=decode_attention, separate_decode=int(apart)
    )
    timed = cost is not None and config.max_step_ms is not None and bool(decodes)
    seconds = 0.0
    over_time: ChunkLimit = "time"  # what a chunk the time left cuts is limited by
    if timed:
        assert cost is not None and config.max_step_ms is not None
        seconds = step_seconds(cost.predict(beside_chunks) + cost.per_chunk, config.max_step_ms)
        if seconds > config.max_step_ms / 1e3:  # stretched past the target to its floor
            over_time = "floor"

    def chunk_size(s: RequestState, start: int) -> tuple[int, ChunkLimit]:
        """Tokens for this request's next chunk: the token rules, then the time left, then
        its image spans (whole or not at all); and what limited it: the rule that gave the
        size, the first of prompt-end, budget, long-prefill-cap where they tie, and the time
        ("floor" where the step is stretched past the target, or the chunk is the one token
        the first prompt always gets) or an image only where they cut below those."""
        n, limit = s.num_prompt_tokens - start, "prompt-end"
        if budget < n:
            n, limit = budget, "budget"
        cap = config.long_prefill_cap
        if cap is not None and cap < n:
            n, limit = cap, "long-prefill-cap"
        if timed and n > 0:
            assert cost is not None
            base = features if chunks else beside_chunks
            left = seconds - cost.predict(base.with_encode(units))
            fits = cost.max_chunk_tokens(start, left)
            if fits < n:
                n, limit = fits, over_time
            if not chunks and n < 1:
                n, limit = 1, "floor"  # the first prompt in the order always moves
        if s.images and n > 0:
            cut = cut_at_images(s, start, n)
            if cut < n:
                n, limit = cut, "image"
        return n, limit

    def encode_size(s: RequestState, i: int) -> int:
        """Encoder units for image `i` of this request: what is left, then the time left;
        the step's first work always moves (nothing starves)."""
        k = s.images[i].units - s.encoded[i]
        if timed:
            assert cost is not None
            left = seconds - cost.predict(features.with_encode(units))
            # an encoder not priced yet runs a unit a step until the model has its measure
            price = cost.per_encode_unit
            k = min(k, max(0, int(left / price)) if price > 0 else 1)
            if not chunks and not encodes:
                k = max(k, 1)
        return k

    def add(s: RequestState, n: int, start: int, limit: ChunkLimit) -> None:
        nonlocal budget, features
        features = (features if chunks else beside_chunks).with_chunk(start, n)
        chunks.append(_chunk(s, n, start, limit))
        num_scheduled[s.request_id] = n
        budget -= n

    # Prompts, mid-prefill or waiting, shortest left first; one that has not moved for
    # `MAX_WAIT_STEPS` steps before every other (`admission_key`); a waiting one whose client
    # runs its fair share after those of clients that do not (`fair_order`).
    prompts = [(s, s.num_computed_tokens) for s in running if s.status is Status.PREFILLING]
    candidates = startable(live, prefix)
    prompts += [(s, first_chunk_start(s, prefix)) for s in candidates]
    prompts.sort(key=lambda p: admission_key(p[0], step, p[1]))
    kept, moved = fair_split(prompts, live, config.max_num_seqs)
    prompts = kept + moved if moved else kept
    num_running = len(running)
    lengths = [kv_length(s) for s in running] if candidates else []
    closed: HeldReason | None = None  # why waiting requests may no longer start this step
    held: dict[str, HeldReason] = {}  # prompts left out for their own reasons, and why
    out_of_budget = False  # the budget ran out before the order's end
    last_started = -1  # the last waiting request of `kept` (in their order) that started
    for i, (s, start) in enumerate(prompts):
        if budget <= 0:
            out_of_budget = True
            break
        waiting = s.status is Status.WAITING
        if waiting:
            if closed is not None or num_running >= config.max_num_seqs:
                continue  # held for `closed`, or max-num-seqs (`oldest_held`'s `waiting`)
            if (
                config.max_kv_tokens is not None
                and batch_kv_tokens([*lengths, kv_length(s)], config) > config.max_kv_tokens
            ):
                # an aged request that does not fit holds back the younger ones; a young
                # one waits, and one behind it may fit
                held[s.request_id] = "kv"
                if is_aged(s, step):
                    closed = "kv"
                continue
        image = pending_image(s, start) if s.images else None
        if image is not None and s.images[image].start <= start:
            # its next work is the image's encoder: units, as many as the time allows
            k = encode_size(s, image)
            if k < 1:
                held[s.request_id] = "time"
                if waiting and closed is None:
                    closed = "time"
                continue
            done = s.encoded[image]
            cached = start if waiting else 0
            encodes.append(ScheduledEncode(s.request_id, image, done, done + k, cached))
            units += k
        else:
            n, limit = chunk_size(s, start)
            if n < 1 and not chunks and s.images:
                n, limit = whole_image_at(s, start), "image"  # nothing else runs beside it
            if n < 1:
                # no time left (or an image span that does not fit): the rest next step
                why: HeldReason = "image" if limit == "image" else "time"
                held[s.request_id] = why
                if waiting and closed is None:
                    closed = why
                continue
            add(s, n, start, limit)
        if waiting:
            if i < len(kept):
                last_started = i
            num_running += 1
            lengths.append(kv_length(s))

    went_before = None
    if moved and last_started >= 0:
        last, at = prompts[last_started]  # `kept` keeps the order: the last that started
        went_before = partial(_goes_before, admission_key(last, step, at), step, prefix)

    if closed is None:  # why the waiting requests left out with no reason of their own were
        full = num_running >= config.max_num_seqs
        closed = "budget" if out_of_budget and not full else "max-num-seqs"
    scheduled = {*num_scheduled, *(e.request_id for e in encodes)} if encodes else num_scheduled
    return StepPlan(
        step=step,
        decodes=tuple(decodes),
        chunks=tuple(chunks),
        encodes=tuple(encodes),
        num_scheduled_tokens=num_scheduled,
        features=features.with_encode(units),
        predicted_seconds=cost.predict(features.with_encode(units)) if cost is not None else None,
        held=oldest_held(
            live,
            scheduled,
            held,
            prefix.deferred,
            closed,
            went_before=went_before,
        ),
        drafts=drafted,
    )


def _fit_drafts(
    drafts: Mapping[str, Sequence[int]],
    states: Mapping[str, RequestState],
    decodes: Sequence[str],
    budget: int,
    features: StepFeatures,
    config: SchedulerConfig,
    cost: StepCost | None,
    num_scheduled: dict[str, int],
    out: dict[str, tuple[int, ...]],
) -> tuple[int, StepFeatures]:
    """Each decode row's drafts, cut to the budget left, to the tokens its request may still
    make, and (with a cost model and a target) to the step's time: the target, or where the
    decode rows alone take longer, `DRAFT_STRETCH` times their time; into `out` and the rows'
    scheduled tokens. Returns the budget left and the step's features with them."""
    timed = cost is not None and config.max_step_ms is not None
    target = 0.0
    if timed:
        assert cost is not None and config.max_step_ms is not None
        target = max(config.max_step_ms / 1e3, DRAFT_STRETCH * cost.predict(features))
    for rid in decodes:
        proposed = drafts.get(rid)
        if proposed is None:
            continue
        s = states[rid]
        room = s.params.max_tokens - s.num_output_tokens - 1  # the row's own token first
        n = max(0, min(len(proposed), budget, room))
        context = decode_context(s)
        if timed and n > 0:
            assert cost is not None
            while n > 0 and cost.predict(features.with_drafts(context, n)) > target:
                n -= 1
        out[rid] = tuple(proposed[:n])
        if n:
            features = features.with_drafts(context, n)
            num_scheduled[rid] += n
            budget -= n
    return budget, features


def prefix_candidates(
    states: Mapping[str, RequestState],
    prompt_of: Callable[[str], Sequence[int]],
    step: int,
    config: SchedulerConfig,
    disk_tried: Container[str],
) -> list[Candidate]:
    """The requests whose cached prefix step `step` may look up (`plan_prefixes`): those
    prefilling towards a checkpoint, and the head of the waiting queue in the admission
    order, fair share included (`max_num_seqs` of them, cache hits not known yet: none
    beyond it can start first). `disk_tried`: requests a disk entry was already loaded
    for."""

    def candidate(s: RequestState, *, waiting: bool) -> Candidate:
        return Candidate(
            request_id=s.request_id,
            prompt=prompt_of(s.request_id),
            num_computed_tokens=s.num_computed_tokens,
            checkpoints=s.checkpoints,
            waiting=waiting,
            allow_disk=s.request_id not in disk_tried,
        )

    running: list[Candidate] = []
    queue: list[RequestState] = []
    for s in sorted(states.values(), key=lambda s: s.admitted_seq):
        if s.status is Status.WAITING:
            queue.append(s)
        elif s.status is Status.PREFILLING and any(
            c > s.num_computed_tokens for c in s.checkpoints
        ):
            running.append(candidate(s, waiting=False))
    queue.sort(key=lambda s: admission_key(s, step, s.num_computed_tokens))
    order = fair_order(
        [(s, s.num_computed_tokens) for s in queue], states.values(), config.max_num_seqs
    )
    head = order[: config.max_num_seqs]
    return [*running, *(candidate(s, waiting=True) for s, _ in head)]


def is_aged(s: RequestState, step: int) -> bool:
    """Whether request `s`'s prompt has not moved for `MAX_WAIT_STEPS` steps by step `step`
    (since it was admitted, or since its last chunk)."""
    return step - s.moved_step >= MAX_WAIT_STEPS


def admission_key(s: RequestState, step: int, start: int) -> tuple[bool, int, int]:
    """Sort key of the prompts' order, for a prompt whose next chunk starts at `start`:
    aged ones first (`is_aged`), oldest first; then the others, shortest prompt left first,
    ties oldest first."""
    if is_aged(s, step):
        return (False, 0, s.admitted_seq)
    return (True, s.num_prompt_tokens - start, s.admitted_seq)


def _goes_before(
    key: tuple[bool, int, int], step: int, prefix: PrefixPlan, s: RequestState
) -> bool:
    """Whether waiting request `s` goes before a prompt of admission key `key` (but for
    fair share): `schedule`'s test of a held request's "fair-share"."""
    return s.status is Status.WAITING and admission_key(s, step, first_chunk_start(s, prefix)) < key


Prompt = tuple[RequestState, int]  # a request, and where its next chunk starts


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
    if len({s.client for s, _ in prompts if s.status is Status.WAITING}) < 2:
        return prompts, []
    share = max_num_seqs / len({s.client for s in live})
    running = Counter(s.client for s in live if s.status in _RUNNING)
    kept: list[Prompt] = []
    held: list[tuple[int, int, Prompt]] = []
    for i, p in enumerate(prompts):
        s = p[0]
        if s.status is Status.WAITING:
            place = running[s.client]  # its client's running requests when it starts
            running[s.client] += 1
            if place >= share:
                held.append((place, i, p))
                continue
        kept.append(p)
    held.sort(key=lambda h: h[:2])
    return kept, [p for _, _, p in held]


def startable(live: list[RequestState], prefix: PrefixPlan) -> list[RequestState]:
    """Waiting requests that may start this step (`schedule` orders them among the prompts
    by `admission_key`, with each one's cache hit). Only requests the prefix plan looked at
    may start (it looks at a window of the queue: the others' cache hits are unknown)."""
    return [
        s
        for s in live
        if s.status is Status.WAITING
        and s.request_id not in prefix.deferred
        and (prefix.considered is None or s.request_id in prefix.considered)
    ]


def outside_images(prefix: PrefixPlan, states: Mapping[str, RequestState]) -> PrefixPlan:
    """`prefix` with each cache hit that would end inside an image span of its request cut
    back to the span's start (none: before its first token). Keys of different images
    differ from their span's first token on (`spans.prompt_key`), so this is a guard; an
    entry that serves only at its exact length never ends inside a span (chunks do not)."""
    cut = {}
    for rid, n in prefix.cached.items():
        s = states.get(rid)
        image = inside_image(s.images, n) if s is not None and s.images else None
        if image is not None:
            cut[rid] = image.start
    if not cut:
        return prefix
    cached, matches = dict(prefix.cached), dict(prefix.matches)
    for rid, n in cut.items():
        if n == 0:
            cached.pop(rid)
            matches.pop(rid, None)
        else:
            cached[rid] = n
            if rid in matches:
                matches[rid] = replace(matches[rid], num_tokens=n)
    return replace(prefix, cached=cached, matches=matches)


def first_chunk_start(s: RequestState, prefix: PrefixPlan) -> int:
    """Where waiting request `s`'s first chunk starts: after its cache hit, if it has one."""
    return prefix.cached.get(s.request_id, s.num_computed_tokens)


class AdmissionError(ValueError):
    """A request that can never be served under this configuration."""


def max_output_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_context: int,
    config: SchedulerConfig | None = None,
) -> int:
    """The most tokens a request of `num_prompt_tokens` may generate: `requested` (None: as
    many as there is room for), no more than the model's context leaves after the prompt,
    and, given `config`, no more than its KV budget leaves (`max_kv_tokens` less the prompt
    and `kv_tokens_per_seq`; at least 1, so that a prompt that alone overflows the budget is
    refused by `check_admissible`, which says why). 0 or less only for a prompt that fills
    the context (`check_admissible` refuses it).

    The scheduler core records a request's `max_tokens` as this (without `config`) when it
    admits it: the core, the runner and the request actor read that one value."""
    room = max_context - num_prompt_tokens
    if config is not None and config.max_kv_tokens is not None:
        fits = config.max_kv_tokens - num_prompt_tokens - config.kv_tokens_per_seq
        room = min(room, max(fits, 1))
    return room if requested is None else min(requested, room)


def check_admissible(
    num_prompt_tokens: int, max_tokens: int, max_context: int, config: SchedulerConfig
) -> None:
    """Raise AdmissionError (subclass by cause) if the request can never run. `max_tokens`
    is its limit within the context (`max_output_tokens`): its KV is counted up to there."""
    if num_prompt_tokens < 1:
        raise EmptyPromptError("the prompt is empty: send at least one token")
    if num_prompt_tokens >= max_context:
        raise ContextLengthExceededError(num_prompt_tokens, max_context)
    needed = num_prompt_tokens + max_tokens + config.kv_tokens_per_seq
    if config.max_kv_tokens is not None and needed > config.max_kv_tokens:
        raise KVBudgetExceededError(needed, num_prompt_tokens, max_tokens, config)


def check_queue(
    states: Mapping[str, RequestState], config: SchedulerConfig, client: str | None = None
) -> None:
    """Raise QueueFullError if `max_waiting` requests already wait for their first chunk, or
    `max_waiting_per_client` of `client`'s do."""
    num_waiting = mine = 0
    for s in states.values():
        if s.status is Status.WAITING:
            num_waiting += 1
            mine += s.client == client
    if num_waiting >= config.max_waiting:
        raise QueueFullError(num_waiting, config.max_waiting)
    if mine >= config.max_waiting_per_client:
        raise QueueFullError(mine, config.max_waiting_per_client, per_client=True)


class KVBudgetExceededError(AdmissionError):
    """The request's KV can never fit in the engine's KV budget, even with nothing else running."""

    def __init__(
        self, needed: int, num_prompt_tokens: int, max_tokens: int, config: SchedulerConfig
    ):
        assert config.max_kv_tokens is not None
        self.num_kv_tokens = needed
        self.max_kv_tokens = config.max_kv_tokens

        def size(tokens: int) -> str:
            per = config.kv_bytes_per_token
            return f"{tokens} tokens, {tokens * per / 2**30:.3g} GB" if per else f"{tokens} tokens"

        fixed = (
            f" plus its cache's fixed cost ({config.kv_tokens_per_seq} tokens' worth: the room"
            " its KV buffer grows by, and any recurrent state)"
            if config.kv_tokens_per_seq
            else ""
        )
        super().__init__(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}){fixed} needs "
            f"KV for {size(needed)}, more than the engine holds ({size(config.max_kv_tokens)}, "
            "max_kv_tokens / --max-kv-gb): shorten the prompt or lower max_tokens"
        )


class EmptyPromptError(AdmissionError):
    pass


class QueueFullError(AdmissionError):
    """The waiting queue is full, or the client's share of it (`per_client`: then the
    numbers are the client's): try again later (HTTP 429 with Retry-After)."""

    def __init__(
        self,
        num_waiting: int,
        max_waiting: int,
        retry_after_s: float = 1.0,
        *,
        per_client: bool = False,
    ):
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.per_client = per_client
        if per_client:
            message = (
                f"this client already has {num_waiting} requests waiting, the most one client "
                "may have (the rest of the engine's waiting queue is kept for other clients): "
                "retry later"
            )
        else:
            message = (
                f"the engine's waiting queue is full ({num_waiting} of {max_waiting} requests "
                "waiting): retry later"
            )
        super().__init__(message)


class ContextLengthExceededError(AdmissionError):
    def __init__(self, num_prompt_tokens: int, max_context: int):
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context = max_context
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens but the model's context is {max_context} "
            f"tokens (prompt must be at most {max_context - 1} so one token can be generated): "
            "shorten the prompt"
        )
