"""Reading a log fast, for questions about all of it (replay's summary and verify).

`read_events` validates every line into a pydantic event: ~40 µs a line of a busy engine's
log, most of it in a step's plan and tokens (a row per member). Here msgspec decodes those
lines into light structs: ~1 µs a line. The structs are made from the event models
(events/models.py), so the events are their one schema: each light struct has its event's
`type` tag, fields, types and defaults, and runs its event's row checks; the parts a bulk
fold does not read (a prompt's ids and parameters, images, a step's token ids) stay raw
JSON. Rare events, and every event for a consumer that asks for them (`exact`), go the
validated way; so does every line of a log of an older schema (its upcasters work on dicts).
Runs, torn lines, models and errors are `read_run_events`'s own: this only changes how a
good line becomes an object.

A light event has the event's `type` tag and fields, so code that reads attributes and
dispatches on `type` takes either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union

import msgspec
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from stepline.events.log_reader import LogRun, run_events
from stepline.events.models import (
    EVENT_ADAPTER,
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Event,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)

# A light struct: its event's fields, in a frozen struct told apart by its `type` tag.
LightEvent = Any


def _check_tokens(event: Any) -> None:
    """`TokensSampled`'s row check on its raw token ids: one token per request id."""
    ids = bytes(event.token_ids).strip()
    if ids != b"null" and ids.count(b",") + 1 != len(event.request_ids):
        if not (ids[1:-1].strip() == b"" and not event.request_ids):
            raise ValueError("token_ids must have one token per request id (a row each)")


def light_struct(
    model: type[BaseModel],
    *,
    raw: tuple[str, ...] = (),
    check: Callable[[Any], Any] | None = None,
) -> type[msgspec.Struct]:
    """The light struct of the event `model`: its fields with their types and defaults (the
    `raw` ones as raw JSON, their defaults encoded), its `type` tag, and as its row check
    `check`, or else the model's own after-validators (they read only the fields)."""
    tag = model.model_fields["type"].default
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for name, info in model.model_fields.items():
        if name == "type":
            continue
        kind = msgspec.Raw if name in raw else info.annotation
        if info.default_factory is not None:
            default: Any = info.default_factory()  # type: ignore[call-arg]
        else:
            default = info.default
        if default is PydanticUndefined:
            fields.append((name, kind))
        else:
            fields.append(
                (name, kind, msgspec.Raw(msgspec.json.encode(default)) if name in raw else default)
            )
    checks = (
        [check]
        if check is not None
        else [
            d.func
            for d in model.__pydantic_decorators__.model_validators.values()
            if d.info.mode == "after"
        ]
    )
    namespace: dict[str, Any] = {
        "type": tag,
        "__doc__": f"`{model.__name__}`, light.",
        # the fields its line leaves out when their value says so (pydantic's `exclude_if`)
        "left_out_if": {
            name: info.exclude_if
            for name, info in model.model_fields.items()
            if info.exclude_if is not None
        },
    }
    if checks:

        def __post_init__(self: Any) -> None:
            for one in checks:
                one(self)

        namespace["__post_init__"] = __post_init__
    return msgspec.defstruct(
        f"Light{model.__name__}",
        fields,
        namespace=namespace,
        tag_field="type",
        tag=tag,
        frozen=True,
        kw_only=True,
        gc=False,
        module=__name__,
    )


LightStep = light_struct(StepPlanned)
LightDecoding = light_struct(TokensSampled, raw=("token_ids",), check=_check_tokens)
LightStepFinished = light_struct(StepFinished)
LightAdmitted = light_struct(Admitted, raw=("prompt_token_ids", "params", "images"))
LightChunk = light_struct(ChunkPrefilled)
LightCheckpoint = light_struct(CheckpointReached)
LightTerminal = light_struct(Terminal)

# The per-step kinds: the bulk of a log's bytes (a row per member), light for every consumer.
STEP_KINDS: tuple[type[msgspec.Struct], ...] = (LightStep, LightDecoding, LightStepFinished)
# Every kind a line can be made light as (the rest are validated).
ALL_KINDS: tuple[type[msgspec.Struct], ...] = (
    *STEP_KINDS,
    LightAdmitted,
    LightChunk,
    LightCheckpoint,
    LightTerminal,
)
_TAG = b'"type":"'


def _decoder(kinds: tuple[type[msgspec.Struct], ...]) -> Callable[[bytes], Any]:
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
_LIGHT_ALL = msgspec.json.Decoder(Union[ALL_KINDS]).decode  # noqa: UP007 (a runtime union)


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
    left_out = event.left_out_if
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name in left_out and left_out[name](value):
            continue  # as the line leaves it out
        out[name] = msgspec.json.decode(value) if isinstance(value, msgspec.Raw) else value
    return msgspec.to_builtins(out)
