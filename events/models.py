"""Event models: one frozen pydantic model per kind, one discriminated union.

Every event carries a monotonically increasing sequence number (`seq`, contiguous
from 1 within one run of the engine), a wall-clock timestamp, the engine step it belongs
to and the request id (the `step` and `step-finished` records belong to no request).

Schema history: 2 added the run id and the prompt-digest salt to the header, `log_outputs`,
`Decoding.token_count` (token ids may be left out) and `StepFinished`. Every addition has a
default that describes a version-1 log correctly, so the 1 -> 2 upcaster changes nothing.
3 records a step's sampled tokens as one `TokensSampled` event (rows: request, token) in
place of one `Decoding` event per request, and a step's members as parallel tuples of
`StepPlanned`; the 2 -> 3 upcaster turns each `Decoding` into a `TokensSampled` of its
request's rows, and a plan's `entries` into those tuples. `Decoding` stays as the
per-request view of a `TokensSampled` (`decodings()`), which is what the readers of the log
fold and show. 4 added `Admitted.client` (who sent the request, for fair share between
clients); its default (None: the one anonymous client) describes a version-3 log, so the
3 -> 4 upcaster changes nothing. 5 added images (`Admitted.images`, `ChunkPrefilled.images`,
`ImageEncoded`); their default (none) describes a version-4 log, so the 4 -> 5 upcaster
changes nothing. 6 added several models in one server: every event may name the model
it belongs to (`model`; None: the run's one model), the run's header lists the models it
serves (`LogHeader.models`), and `ModelLoaded`, `ModelLoadFailed` and `ModelUnloaded`
record their loads and unloads. A model's events (its `seq` and `step`) count on from its
earlier loads within a run, so each model's events read as one run of one model; the 5 -> 6
upcaster changes nothing. 7 says why: a step's plan records what sized each chunk
(`StepPlanned.limits`) and which requests sat the step out and why (`held_ids`,
`held_reasons`); a step's time records the engine's warm-up and the host's load
(`StepFinished.warming_up`, `cpu_share`, `load_avg`); a request refused at a door is a lone
`Terminal` (reason rejected, with the error's `code` and `status`); and a step's tokens are
a `decoding` event (the mission's name; 3 to 6 called it `tokens`). The 6 -> 7 upcaster
renames `tokens` to `decoding`; the other additions' defaults (not recorded) describe a
version-6 log. 8 added `Parked` and `Resumed`: a decoding request of a client running more
than its fair share steps out of the decode batch (its cache kept) so that another client's
request gets a seat, and steps back in later; a version-7 log has none. It also says why a request's
prefix-cache hit stops where it does (`ChunkPrefilled.prefix_miss`, `prefix_shared`, and the
same on `ImageEncoded`), "not recorded" in a version-7 log, so the 7 -> 8 upcaster changes
nothing. 9 added LoRA adapters (`Admitted.adapter`, `AdapterLoaded`); the 8 -> 9 upcaster
changes nothing. 10 says where a request came from (`Admitted.origin`): a client's, or one the
engine sent itself (a chat's next turn prefilled once it ended, api/pipeline/next_turn.py),
which takes only what no client's request wants. Every request of a version-9 log was a
client's (the default), so the 9 -> 10 upcaster changes nothing. 11 added a request's end by
its loop guard (`FinishReason.LOOP`: its answer repeated itself verbatim, actors/scheduler/
loop_guard.py), whether a request has one (`RequestParams.loop_guard`) and the window its
penalties look at (`RequestParams.repeat_last_n`); a version-10 log has no such end and its
requests neither (the defaults, left out of the line), so the 10 -> 11 upcaster changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

SCHEMA_VERSION = 11

# Where a request came from (`Admitted.origin`): a client's (any door, the Python API), or the
# engine's own prefill of a chat's next turn (api/pipeline/next_turn.py).
Origin = Literal["client", "next-turn"]


class FinishReason(StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached
    # its loop guard ended it: the answer had been repeating itself verbatim (a door says
    # "length": OpenAI's finish_reason, Anthropic's "max_tokens", Ollama's done_reason)
    LOOP = "loop"
    CANCELLED = "cancelled"  # the client went away or cancelled
    ERROR = "error"  # the engine failed while serving it
    REJECTED = "rejected"  # never admitted: it cannot be served (too long, engine dead)


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int  # position in the log, contiguous from 1 (per model, in a log of several)
    ts: float  # time.time() when the step loop recorded it
    step: int  # engine step; 0 = before the first step
    # The served model it belongs to, in a log of several (`LogHeader.models`); None: the
    # run's one model. Left out of the line when None.
    model: str | None = None


class EmbedParams(BaseModel):
    """What makes a request an embedding's (engine/embed.py): its prompt is prefilled and its
    final chunk's result is the model body's hidden states pooled, no token sampled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pooling: Literal["last", "mean", "cls"]  # the last token's, the mean of all, the first's
    normalize: bool = True  # to unit length (sentence-transformers' `Normalize`)
    # A reranker's (Qwen3-Reranker's "no" and "yes"): the result is the output head's logits
    # of these token ids at the last token, not the hidden state (pooling "last")
    head_tokens: tuple[int, ...] = ()
    # A non-causal model's (a BERT-family encoder, engine/bert.py): every token attends to
    # every other, so the prompt goes in one chunk. Left out of the line when false.
    whole: bool = Field(default=False, exclude_if=lambda whole: not whole)


def _absent(value: object) -> bool:
    return value is None


def _is_false(value: object) -> bool:
    return value is False


def _is_image(value: object) -> bool:
    return value == "image"


class RequestParams(BaseModel):
    """What re-execution needs to run a request again: its sampling parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The last tokens of the context (prompt and answer) the three penalties look at (Ollama's
    # and llama.cpp's `repeat_last_n`); None: all of them. Written only where set.
    repeat_last_n: int | None = Field(default=None, exclude_if=_absent)
    # Whether an answer that repeats itself verbatim ends there (reason loop); written only
    # where set.
    loop_guard: bool = Field(default=False, exclude_if=_is_false)
    grammar: str | None = None  # llguidance grammar the output must follow (engine/grammar.py)
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k
    # An embedding request (max_tokens 0): how its hidden states are pooled. Written only where
    # set, so a generating request's line is as it was.
    embed: EmbedParams | None = Field(default=None, exclude_if=_absent)


class Admitted(_Event):
    """The engine accepted the request into its waiting queue."""

    type: Literal["admitted"] = "admitted"
    request_id: str
    num_prompt_tokens: int
    # The prompt's token ids, or None when the engine runs with log_prompts=False.
    prompt_token_ids: tuple[int, ...] | None
    # prompt_digest(salt, token ids) with the run header's salt (plain SHA-256 when the
    # header has no salt: schema 1), always present
    prompt_sha256: str
    checkpoints: tuple[int, ...] = ()  # prompt offsets where the cache is snapshotted
    # Logs before the prefix lookup moved to scheduling time recorded cache hits here;
    # now the first `chunk-prefilled` event does, and these stay 0 / None.
    num_cached_tokens: int = 0
    cache_source: str | None = None
    params: RequestParams
    # Who sent it: the scheduler shares the running slots fairly between clients
    # (actors/scheduler/order.py). The HTTP server's fingerprint of its API key and `user`,
    # never the key itself; None: the anonymous client (every request that names none).
    client: str | None = None
    images: tuple[ImageRef, ...] = ()  # the prompt's images, in prompt order
    # The LoRA adapter it runs with (its name, a model the server lists; engine/lora.py);
    # None: the base model. Left out of the line when None.
    adapter: str | None = None
    # The door it came in at: the HTTP path it was sent to (`/v1/chat/completions`,
    # `/v1/messages`, `/api/chat`, ...); None: the Python API (and logs before it was kept).
    # Optional, left out of the line when None: no schema change.
    door: str | None = Field(default=None, exclude_if=_absent)
    # Who asked for it (`Origin`): a next turn's prefill runs only in what no client's
    # request wants, and is ended first (actors/scheduler/background.py). Left out of the
    # line for a client's.
    origin: Origin = "client"


class ImageRef(BaseModel):
    """An image (or an audio clip: `medium`) of a prompt, as the log knows it: its content
    digest (SHA-256 of the bytes sent), its size, the prompt tokens it stands for ([start,
    end)), and the encoder's work for it in `units` (steps may run some of them each:
    `ImageEncoded`). No chunk reaches into the span before its units are all done; where
    `whole`, the span's tokens are then prefilled in one chunk (a family whose image tokens
    attend to each other both ways, a sentinel-wrapped audio span), else they are chunked as
    text is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str
    start: int
    end: int
    num_bytes: int
    width: int  # 0 for a clip
    height: int
    units: int = 1
    whole: bool = True
    # "audio": a clip (its `seconds`, and `num_samples` at the model's rate, what its encoder
    # hears); written only for audio, so an image's line is as it was
    medium: Literal["image", "audio"] = Field(default="image", exclude_if=_is_image)
    seconds: float | None = Field(default=None, exclude_if=_absent)
    num_samples: int | None = Field(default=None, exclude_if=_absent)


# What sized a prefill chunk (`StepPlanned.limits`): the prompt's end; a checkpoint (chunks
# end at checkpoints); the step's token budget; the step-time target (the cost model's
# prediction); the floor (the smallest chunk the time target may cut to); the long-prefill cap;
# KV memory; an image's span (atomic, or waiting for its encoding). The step budget
# (actors/scheduler/budget.py) names neither "checkpoint" nor "kv" today: a chunk runs
# through its checkpoints (the runner splits it there, and its `chunk-prefilled` events end
# there), and KV memory only gates admission (a held request's "kv").
ChunkLimit = Literal[
    "prompt-end", "checkpoint", "budget", "time", "floor", "long-prefill-cap", "kv", "image"
]
# Why a request that could have run sat a step out (`StepPlanned.held_reasons`): no token of
# the budget left; the time target reached; max_num_seqs running; its KV does not fit; its
# client had its fair share; its image did not fit the step; it waits for a prefix that an
# earlier request is computing, or for its cache entry to load from disk (it starts from it).
HeldReason = Literal["budget", "time", "max-num-seqs", "kv", "fair-share", "image", "prefix"]
# Why a request's prefix-cache hit stops where it does (its first chunk or encoder step
# says; actors/scheduler/prefix_index.py `PrefixIndex.explain`): "cold", nothing cached
# starts as its prompt does; "diverged", its prompt first differs from everything cached
# at `prefix_shared`; "no-snapshot", a cached entry shares more of it (up to
# `prefix_shared`), but its state (recurrent, a wrapped window) exists only at its own
# length; "evicted", an entry that shared more was evicted from the cache.
PrefixMiss = Literal["cold", "diverged", "no-snapshot", "evicted"]
# At most this many held requests are recorded a step (the oldest first).
MAX_HELD = 8

# "encode": vision-encoder work for a request's image (no prompt tokens: num_tokens 0)
StepKind = Literal["prefill", "decode", "encode"]


class StepEntry(NamedTuple):
    """One member of a step's plan (a row of `StepPlanned`)."""

    request_id: str
    num_tokens: int  # tokens scheduled for this request in this step
    kind: StepKind


class StepPlanned(_Event):
    """A step's plan: its members and their tokens, and the limits it ran under. Members are
    parallel tuples (row i: `request_ids[i]` runs `num_tokens[i]` tokens of `kinds[i]`), one
    model a step rather than one a member; `entries` gives them as rows."""

    type: Literal["step"] = "step"
    request_id: None = None
    request_ids: tuple[str, ...]
    num_tokens: tuple[int, ...]
    kinds: tuple[StepKind, ...]
    max_step_tokens: int
    max_num_seqs: int
    # per member, what sized its chunk (None: a decode or encode row); empty: not recorded
    # (logs before schema 7)
    limits: tuple[ChunkLimit | None, ...] = ()
    # requests that could have joined the step and did not (at most MAX_HELD, oldest first),
    # and why (`held_reasons[i]` for `held_ids[i]`)
    held_ids: tuple[str, ...] = ()
    held_reasons: tuple[HeldReason, ...] = ()

    @model_validator(mode="after")
    def _rows_line_up(self) -> StepPlanned:
        if not len(self.request_ids) == len(self.num_tokens) == len(self.kinds):
            raise ValueError("request_ids, num_tokens and kinds must have one item per member")
        if self.limits and len(self.limits) != len(self.request_ids):
            raise ValueError("limits must have one item per member (or none)")
        if len(self.held_ids) != len(self.held_reasons):
            raise ValueError("held_ids and held_reasons must have one item per held request")
        return self

    @property
    def entries(self) -> tuple[StepEntry, ...]:
        """The step's members as rows (built on each call: bind it once)."""
        return tuple(map(StepEntry, self.request_ids, self.num_tokens, self.kinds))


class ChunkPrefilled(_Event):
    """Prompt tokens [start, end) of the request were computed into its cache.

    A request's first chunk says how many prompt tokens it started with from the prefix
    cache (then `start` equals that number) and where they came from.
    """

    type: Literal["chunk-prefilled"] = "chunk-prefilled"
    request_id: str
    start: int
    end: int
    num_cached_tokens: int = 0
    cache_source: str | None = None  # "memory" or "disk" when num_cached_tokens > 0
    images: tuple[str, ...] = ()  # digests of the images whose span tokens it holds
    # A request's first step, where it reused less than all but its last prompt token from
    # the prefix cache: why, and how far its prompt matched what the cache held or had held
    prefix_miss: PrefixMiss | None = None
    prefix_shared: int = 0


class ImageEncoded(_Event):
    """Units [start, end) of the vision encoder's work for the request's image number
    `image` (in prompt order) were computed; at the image's `units` its span's embeddings
    are ready. A request whose first step encodes says here how many prompt tokens it
    starts with from the prefix cache (as a first chunk does)."""

    type: Literal["image-encoded"] = "image-encoded"
    request_id: str
    image: int
    start: int
    end: int
    num_cached_tokens: int = 0
    cache_source: str | None = None
    prefix_miss: PrefixMiss | None = None  # as a first chunk's (`ChunkPrefilled`)
    prefix_shared: int = 0


class CheckpointReached(_Event):
    """The request's cache was snapshotted at exactly `offset` prompt tokens."""

    type: Literal["checkpoint-reached"] = "checkpoint-reached"
    request_id: str
    offset: int


class Decoding(_Event):
    """Tokens sampled for one request in one step (the first comes with its last chunk): one
    request's part of a `TokensSampled` event, with that event's seq, ts and step. Logs of
    schema 2 held these; the engine now records a step's tokens as one `TokensSampled`."""

    type: Literal["decoding"] = "decoding"
    request_id: str
    token_ids: tuple[int, ...] | None  # None when the log leaves outputs out (log_outputs)
    token_count: int | None = None  # how many tokens, when token_ids is None

    @property
    def num_tokens(self) -> int:
        """How many tokens were sampled, whether or not their ids are in the log."""
        ids = self.token_ids
        return len(ids) if ids is not None else (self.token_count or 0)


class TokensSampled(_Event):
    """The `decoding` event: the tokens a step sampled, one row per token: `request_ids[i]` sampled
    `token_ids[i]`. One event per step for every request it sampled for, in place of one
    event per request: on the hot path that is one model built, applied and written a step,
    not one a token. `decodings()` gives each request's part as a `Decoding`."""

    type: Literal["decoding"] = "decoding"
    request_id: None = None
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...] | None  # None when the log leaves outputs out (log_outputs)

    @model_validator(mode="after")
    def _one_token_a_row(self) -> TokensSampled:
        if self.token_ids is not None and len(self.token_ids) != len(self.request_ids):
            raise ValueError("token_ids must have one token per request id (a row each)")
        return self

    def decodings(self) -> list[Decoding]:
        """Each request's tokens of this step, in the order the requests first appear."""
        ids = self.token_ids
        rows: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for i, rid in enumerate(self.request_ids):
            counts[rid] = counts.get(rid, 0) + 1
            if ids is not None:
                rows.setdefault(rid, []).append(ids[i])
        seq, ts, step = self.seq, self.ts, self.step
        return [
            Decoding(
                seq=seq,
                ts=ts,
                step=step,
                request_id=rid,
                token_ids=None if ids is None else tuple(rows[rid]),
                token_count=n if ids is None else None,
            )
            for rid, n in counts.items()
        ]


class Parked(_Event):
    """The decoding request left the decode batch after this step, its cache kept: it
    decodes no more until `Resumed`. `reason` "fair-share": its client ran more than its
    share of the seats (`max_num_seqs` / the clients with live requests) while another
    client's request waited for one (actors/scheduler/seats.py)."""

    type: Literal["parked"] = "parked"
    request_id: str
    reason: Literal["fair-share"] = "fair-share"


class Resumed(_Event):
    """The parked request took a seat again: it decodes from this step on."""

    type: Literal["resumed"] = "resumed"
    request_id: str


class Terminal(_Event):
    """The request ended. Exactly one per request; nothing of it follows."""

    type: Literal["terminal"] = "terminal"
    request_id: str
    reason: FinishReason
    message: str | None = None  # for error / rejected: what went wrong
    # For a request refused at a door (never admitted: no `admitted` event before it), the
    # error's code and HTTP status the client got (e.g. "context_length_exceeded", 400)
    code: str | None = None
    status: int | None = None
    # An embedding request that ended with its vector: the vector's length (written only then)
    dimensions: int | None = Field(default=None, exclude_if=_absent)


class StepFinished(_Event):
    """The executor finished the step: how long it took, and how long the scheduler thought."""

    type: Literal["step-finished"] = "step-finished"
    request_id: None = None
    seconds: float  # the executor's measured wall time of the step
    predicted_seconds: float | None = None  # the scheduler's cost-model prediction, if any
    warming_up: bool = False  # the engine was still warming up (compiling, learning its costs)
    cpu_share: float | None = None  # the process's CPU seconds over the step's wall seconds
    load_avg: float | None = None  # the machine's 1-minute load average when the step ended


class ModelLoaded(_Event):
    """A server of several models loaded `model`: its sizes (what the memory budget counts),
    how long the load took and the engine config it serves with (resolved, as a single
    model's header records it: re-execution opens the same)."""

    type: Literal["model-loaded"] = "model-loaded"
    request_id: None = None
    path: str
    weights_bytes: int  # measured once loaded
    kv_bytes: int  # its running requests' KV budget
    prefix_cache_bytes: int  # its prefix cache's budget
    load_seconds: float
    config: dict = Field(default_factory=dict)


class ModelLoadFailed(_Event):
    """A load of `model` failed (missing files, a bad GGUF, no room): the requests waiting
    for it were refused with `message`."""

    type: Literal["model-load-failed"] = "model-load-failed"
    request_id: None = None
    message: str


class ModelUnloaded(_Event):
    """`model` was unloaded: `reason` says why (memory: room for another model; idle: its
    time to live passed; shutdown)."""

    type: Literal["model-unloaded"] = "model-unloaded"
    request_id: None = None
    reason: Literal["memory", "idle", "shutdown", "failed"]
    bytes_freed: int  # what the memory budget counted for it
    idle_seconds: float  # since its last request ended


class AdapterLoaded(_Event):
    """A LoRA adapter was loaded into the model while it served (`POST /v1/load_lora_adapter`,
    `Engine.load_adapter`; those given at start are in the config): requests naming it as
    `Admitted.adapter` run with it from then on, and re-execution loads it from `path`."""

    type: Literal["adapter-loaded"] = "adapter-loaded"
    request_id: None = None
    name: str
    path: str
    kind: str  # "lora" or "dora"
    rank: int
    num_bytes: int  # its matrices' memory


Event = Annotated[
    Admitted
    | StepPlanned
    | StepFinished
    | ChunkPrefilled
    | ImageEncoded
    | CheckpointReached
    | TokensSampled
    | Parked
    | Resumed
    | Terminal
    | ModelLoaded
    | ModelLoadFailed
    | ModelUnloaded
    | AdapterLoaded,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def per_request(event: Event) -> Sequence[Event | Decoding]:
    """`event` as events of one request each: a step's `TokensSampled` as each request's
    `Decoding`; an event of no request (a step's plan or time, a model's load or unload) as
    none; any other event as itself."""
    if isinstance(event, TokensSampled):
        return event.decodings()
    return () if event.request_id is None else (event,)


class LogHeader(BaseModel):
    """First line of every log file, and of every run appended to a log.

    A log may hold several runs (a restart appends a new one); each starts with its own
    header, and every file a run rotates into starts with that same header.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["header"] = "header"
    schema_version: int = SCHEMA_VERSION
    created: float
    model: str | None = None
    config: dict = Field(default_factory=dict)  # the engine config the run used
    log_prompts: bool = True  # prompt token ids stored (else only count and digest)
    log_outputs: bool = True  # output token ids stored (else only their count)
    run_id: str | None = None  # names the run; None in logs written before runs had ids
    salt: str | None = None  # hex key of this run's prompt digests; None: unsalted SHA-256
    # A server of several models: each model's name -> how it is configured (its path,
    # aliases, budgets); `model` and `config` are then empty. Each load's resolved config is
    # its `model-loaded` event's.
    models: dict[str, dict] = Field(default_factory=dict)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names of the models the run serves: its `models`, else its one `model` (none
        when the header names no model)."""
        if self.models:
            return tuple(self.models)
        return (self.model,) if self.model is not None else ()

    def model_of(self, event: Event) -> str | None:
        """The name of the model `event` of this run belongs to (an event that names none
        belongs to the run's one model)."""
        return event.model if event.model is not None else self.model


def new_run_id() -> str:
    """A fresh random run id (12 hex digits)."""
    return secrets.token_hex(6)


def new_salt() -> str:
    """A fresh random salt for prompt digests (32 hex digits)."""
    return secrets.token_hex(16)


def prompt_digest(salt: str | None, token_ids: Sequence[int]) -> str:
    """The hex digest logged as `Admitted.prompt_sha256`: HMAC-SHA256 of the comma-joined
    token ids keyed with the run's `salt` (plain SHA-256 when `salt` is None, as in schema 1).

    The salt lives in the log's header, so equal prompts in different logs get different
    digests and precomputed tables are useless; whoever holds the log (and so its salt) can
    still test a guessed prompt against it.
    """
    data = ",".join(map(str, token_ids)).encode()
    if salt is None:
        return hashlib.sha256(data).hexdigest()
    return hmac.new(bytes.fromhex(salt), data, hashlib.sha256).hexdigest()
