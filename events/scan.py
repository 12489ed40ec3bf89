"""Reading a log fast, for questions about all of it (replay's summary and verify).

`read_events` validates every line into a pydantic event: ~40 µs a line of a busy engine's
log, most of it in a step's plan and tokens (a row per member). Here msgspec decodes those
lines into light structs that hold the fields a bulk fold reads, with the same names, types
and row checks as the events: ~1 µs a line. Rare events, and every event for a consumer that
asks for them (`exact`), go the validated way; so does every line of a log of an older
schema (its upcasters work on dicts). Runs, torn lines, models and errors are
`read_run_events`'s own: this only changes how a good line becomes an object.

A light event has the event's `type` tag and fields, so code that reads attributes and
dispatches on `type` takes either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from stepline.events.log_reader import LogRun, run_events
from stepline.events.models import EVENT_ADAPTER, MAX_HELD, Event, FinishReason

_NULL = msgspec.Raw(b"null")


class _Light(msgspec.Struct, frozen=True, gc=False, tag_field="type", kw_only=True):
    seq: int
    ts: float
    step: int
    model: str | None = None


class LightStep(_Light, tag="step", kw_only=True, frozen=True):
    """`StepPlanned`'s fields, without `entries` (read the parallel tuples)."""

    type: ClassVar[str] = "step"
    request_id: None = None
    request_ids: tuple[str, ...]
    num_tokens: tuple[int, ...]
    kinds: tuple[str, ...]
    max_step_tokens: int
    max_num_seqs: int
    limits: tuple[str | None, ...] = ()
    held_ids: tuple[str, ...] = ()
    held_reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not n == len(self.num_tokens) == len(self.kinds) or (
            self.limits and len(self.limits) != n
        ):
            raise ValueError("request_ids, num_tokens, kinds and limits must line up")
        if len(self.held_ids) != len(self.held_reasons) or len(self.held_ids) > MAX_HELD:
            raise ValueError("held_ids and held_reasons must line up")


class LightDecoding(_Light, tag="decoding", kw_only=True, frozen=True):
    """A step's `decoding` event (`TokensSampled`): its rows' request ids; the token ids are
    checked for their count only (a bulk fold counts tokens, the request actor owns them)."""

    type: ClassVar[str] = "decoding"
    request_id: None = None
    request_ids: tuple[str, ...]
    token_ids: msgspec.Raw = _NULL  # the JSON list, or null (log_outputs off)

    def __post_init__(self) -> None:
        ids = bytes(self.token_ids).strip()
        if ids != b"null" and ids.count(b",") + 1 != len(self.request_ids):
            if not (ids[1:-1].strip() == b"" and not self.request_ids):
                raise ValueError("token_ids must have one token per request id (a row each)")


class LightStepFinished(_Light, tag="step-finished", kw_only=True, frozen=True):
    type: ClassVar[str] = "step-finished"
    request_id: None = None
    seconds: float
    predicted_seconds: float | None = None
    warming_up: bool = False
    cpu_share: float | None = None
    load_avg: float | None = None


class LightAdmitted(_Light, tag="admitted", kw_only=True, frozen=True):
    """`Admitted` without its prompt, parameters and images (decoded as raw JSON)."""

    type: ClassVar[str] = "admitted"
    request_id: str
    num_prompt_tokens: int
    prompt_token_ids: msgspec.Raw = _NULL
    prompt_sha256: str
    checkpoints: tuple[int, ...] = ()
    num_cached_tokens: int = 0
    cache_source: str | None = None
    params: msgspec.Raw
    client: str | None = None
    images: msgspec.Raw = _NULL


class LightChunk(_Light, tag="chunk-prefilled", kw_only=True, frozen=True):
    type: ClassVar[str] = "chunk-prefilled"
    request_id: str
    start: int
    end: int
    num_cached_tokens: int = 0
    cache_source: str | None = None
    images: tuple[str, ...] = ()


class LightCheckpoint(_Light, tag="checkpoint-reached", kw_only=True, frozen=True):
    type: ClassVar[str] = "checkpoint-reached"
    request_id: str
    offset: int


class LightTerminal(_Light, tag="terminal", kw_only=True, frozen=True):
    type: ClassVar[str] = "terminal"
    request_id: str
    reason: FinishReason
    message: str | None = None
    code: str | None = None
    status: int | None = None


LightEvent = (
    LightStep
    | LightDecoding
    | LightStepFinished
    | LightAdmitted
    | LightChunk
    | LightCheckpoint
    | LightTerminal
)

# The per-step kinds: the bulk of a log's bytes (a row per member), light for every consumer.
STEP_KINDS: tuple[type[_Light], ...] = (LightStep, LightDecoding, LightStepFinished)
# Every kind a line can be made light as (the rest are validated).
ALL_KINDS: tuple[type[_Light], ...] = (
    *STEP_KINDS,
    LightAdmitted,
    LightChunk,
    LightCheckpoint,
    LightTerminal,
)
_TAG = b'"type":"'


def _decoder(kinds: tuple[type[_Light], ...]) -> Callable[[bytes], Any]:
    """A line -> event function: light for `kinds` (told apart by the tag, which the writer
    puts near the start of a line), validated for the others."""
    decoders = {
        kind.__struct_config__.tag.encode(): msgspec.json.Decoder(kind)  # type: ignore[union-attr]
        for kind in kinds
    }
    validate = EVENT_ADAPTER.validate_json

    def decode(line: bytes) -> Any:
        i = line.find(_TAG, 0, 96) + 8
        dec = decoders.get(line[i : line.find(b'"', i)]) if i >= 8 else None
        if dec is None:
            return validate(line)
        try:
            return dec.decode(line)
        except msgspec.MsgspecError:  # the validated way says what is wrong, and where
            return validate(line)

    return decode


_LIGHT_STEPS = _decoder(STEP_KINDS)
# Every kind in one decoder: msgspec tells them apart by the tag; a line of another kind
# (model loads, image encoding) is refused and then validated.
_LIGHT_ALL = msgspec.json.Decoder(LightEvent).decode


def scan_run_events(
    path: str | Path,
    *,
    run: int | None = None,
    model: str | None = None,
    requests: bool = True,
) -> Iterator[tuple[LogRun, LightEvent | Event]]:
    """`read_run_events`, fast: its step events (plans, tokens, times) are light structs, and
    with `requests` its request events (admitted, chunk, checkpoint, terminal) too; other
    events (model loads, image encoding) and every event of an older schema are validated
    events. Raises what `read_run_events` raises."""
    if requests:
        return run_events(
            path, run=run, model=model, decode=_LIGHT_ALL, errors=(msgspec.MsgspecError,)
        )
    return run_events(path, run=run, model=model, decode=_LIGHT_STEPS)


def token_ids(event: Any) -> tuple[int, ...] | None:
    """A `decoding` event's token ids (validated, or light: decoded now); None if the log
    leaves them out."""
    ids = event.token_ids
    if isinstance(ids, msgspec.Raw):
        return msgspec.json.decode(ids, type=tuple[int, ...] | None)
    return ids


def to_builtins(event: Any) -> dict[str, Any]:
    """A light event as the JSON object its line holds (its raw parts decoded)."""
    out = {"type": event.type}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        out[name] = msgspec.json.decode(value) if isinstance(value, msgspec.Raw) else value
    return msgspec.to_builtins(out)
