"""Pieces every replay view shares: picking a run and a model, describing a state or an event
for people, and the record of a request that a run left unfinished."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from stepline.events.fold import RequestState, Status
from stepline.events.log import LogRun, read_runs
from stepline.events.models import (
    AdapterLoaded,
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    Event,
    FinishReason,
    ModelLoaded,
    ModelLoadFailed,
    ModelUnloaded,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)
from stepline.events.replay.stats import Report
from stepline.events.scan import to_builtins


class UnknownRequestError(LookupError):
    """The log holds no request with the asked-for id (or several, in different runs)."""


class RequestNotInLogError(UnknownRequestError):
    """The log holds no trace of the asked-for id: neither admitted nor refused."""


class UnknownRunError(LookupError):
    """The log holds no run with the asked-for index or id."""


class RunNeededError(LookupError):
    """The question is about one run, and the log holds several: say which."""


def resolve_run(path: str | Path, run: int | str | None, *, needed: bool = False) -> int | None:
    """The 1-based index of `run` (an index, or a run id) in the log at `path`.

    With `run` None: None, or with `needed` the only run's index (RunNeededError if the log
    holds several). Raises UnknownRunError for a run the log does not hold.
    """
    if run is None and not needed:
        return None
    runs = read_runs(path)
    if run is None:
        if len(runs) == 1:
            return 1
        raise RunNeededError(
            f"{path} holds {len(runs)} runs ({describe_runs(runs)}): pick one with --run"
        )
    for r in runs:
        if str(run) in (str(r.index), r.header.run_id):
            return r.index
    raise UnknownRunError(f"no run {run!r} in {path}: it holds {describe_runs(runs)}")


def describe_runs(runs: list[LogRun]) -> str:
    return ", ".join(r.name for r in runs)


class UnknownModelError(LookupError):
    """The log serves no model of the asked-for name."""


class ModelNeededError(LookupError):
    """The question is about one model, and the log serves several: say which."""


def resolve_model(
    path: str | Path, model: str | None, *, run: int | None = None, needed: bool = False
) -> str | None:
    """The model a view of the log at `path` (of its `run`) looks at: `model`, once checked to
    be one the log serves (`read_models`).

    With `model` None: None (every event), and with `needed` ModelNeededError if the log
    serves several models (their steps interleave, so a view of steps or states must pick
    one). Raises UnknownModelError for a model the log does not serve.
    """
    runs = read_runs(path)
    chosen = [r for r in runs if run in (None, r.index)]
    names = tuple(dict.fromkeys(name for r in chosen for name in r.header.model_names))
    where = f"run {run} of {path}" if run is not None and len(runs) > 1 else str(path)
    if model is None:
        if needed and len(names) > 1:
            raise ModelNeededError(
                f"{where} holds {len(names)} models ({', '.join(names)}), whose steps "
                "interleave: pick one with --model"
            )
        return None
    if model not in names:
        served = f"its models are {', '.join(names)}" if names else "it names no model"
        raise UnknownModelError(f"no model {model!r} in {where}: {served}")
    return model


class InFlight(Report):
    """A request with no terminal event when its run ends.

    In the last run, it may still be running (or the engine was killed); in a run that a
    restart followed, it was interrupted: the engine stopped without ending it.
    """

    request_id: str
    status: Status
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    admitted_step: int
    run: int = 1  # the run it belongs to


def describe_status(
    status: Status,
    num_computed: int,
    num_prompt: int,
    num_output: int,
    reason: FinishReason | None = None,
) -> str:
    """'waiting', 'prefilling k of n', 'decoding, m tokens', 'finished: stop, m tokens'."""
    if status is Status.WAITING:
        return f"waiting ({num_prompt} prompt tokens)"
    if status is Status.PREFILLING:
        return f"prefilling {num_computed} of {num_prompt}"
    if status is Status.DECODING:
        return f"decoding, {num_output} token{'s' * (num_output != 1)}"
    return f"finished: {reason.value if reason else '?'}, {num_output} tokens"


def describe_images(state: RequestState) -> str:
    """', image 1 of 2 encoded 4 of 10 units' while the prefill has reached an image whose
    encoder is not done (its tokens wait for it); '' otherwise."""
    if state.status is not Status.PREFILLING:
        return ""
    for i, (image, done) in enumerate(zip(state.images, state.encoded, strict=True)):
        if done < image.units and image.start <= state.num_computed_tokens:
            what = "audio clip" if image.medium == "audio" else "image"
            return (
                f", {what} {i + 1} of {len(state.images)} encoded {done} of {image.units} "
                f"unit{'s' * (image.units != 1)}"
            )
    return ""


def describe_tokens(token_ids: tuple[int, ...] | None, num_tokens: int) -> str:
    """'[5, 6]', or '2 tokens (ids not logged)' when the log left them out."""
    if token_ids is None:
        return f"{num_tokens} token{'s' * (num_tokens != 1)} (ids not logged)"
    return str(list(token_ids))


_ROWS_SHOWN = 8  # a step's tokens: the first requests' named, the others counted


def describe_event(event: Event | Decoding) -> str:
    """One line for a person: 'seq 12 step 3 chunk-prefilled r1 [0, 512)'."""
    head = f"seq {event.seq} step {event.step} {event.type}"
    if isinstance(event, StepPlanned):
        used = sum(event.num_tokens)
        return (
            f"{head}: {len(event.request_ids)} requests, {used}/{event.max_step_tokens} tokens "
            f"(max_num_seqs {event.max_num_seqs})"
        )
    if isinstance(event, StepFinished):
        return f"{head}: {event.seconds * 1000:.1f} ms"
    if isinstance(event, TokensSampled):
        parts = event.decodings()
        shown = ", ".join(
            f"{d.request_id} {describe_tokens(d.token_ids, d.num_tokens)}"
            for d in parts[:_ROWS_SHOWN]
        )
        more = f", and {len(parts) - _ROWS_SHOWN} more" if len(parts) > _ROWS_SHOWN else ""
        return f"{head}: {len(parts)} request{'s' * (len(parts) != 1)}: {shown}{more}"
    rid = event.request_id
    if isinstance(event, Admitted):
        adapter = f", adapter {event.adapter}" if event.adapter is not None else ""
        return f"{head} {rid}: {event.num_prompt_tokens} prompt tokens{adapter}"
    if isinstance(event, ChunkPrefilled):
        return f"{head} {rid} [{event.start}, {event.end})"
    if isinstance(event, CheckpointReached):
        return f"{head} {rid} at {event.offset}"
    if isinstance(event, Decoding):
        return f"{head} {rid} {describe_tokens(event.token_ids, event.num_tokens)}"
    if isinstance(event, Terminal):
        msg = f" ({event.message})" if event.message else ""
        return f"{head} {rid}: {event.reason.value}{msg}"
    if isinstance(event, ModelLoaded):
        return (
            f"{head} {event.model}: {event.path} in {event.load_seconds:.2f} s, weights "
            f"{describe_bytes(event.weights_bytes)}, KV {describe_bytes(event.kv_bytes)}, "
            f"prefix cache {describe_bytes(event.prefix_cache_bytes)}"
        )
    if isinstance(event, ModelLoadFailed):
        return f"{head} {event.model}: {event.message}"
    if isinstance(event, AdapterLoaded):
        return f"{head} {event.name}: a {event.kind} adapter of rank {event.rank}, {event.path}"
    if isinstance(event, ModelUnloaded):
        return (
            f"{head} {event.model}: {event.reason}, {describe_bytes(event.bytes_freed)} freed, "
            f"idle {event.idle_seconds:.1f} s"
        )
    return head


def describe_bytes(num_bytes: int) -> str:
    """'512 B', '3.2 MiB', '1.50 GiB'."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    if num_bytes < 2**30:
        unit, size = ("KiB", num_bytes / 1024) if num_bytes < 2**20 else ("MiB", num_bytes / 2**20)
        return f"{size:.1f} {unit}"
    return f"{num_bytes / 2**30:.2f} GiB"


def dump_event(event: Any) -> dict[str, Any]:
    """An event (validated, or scan.py's light struct) as the JSON its log line holds."""
    if isinstance(event, msgspec.Struct):
        return to_builtins(event)
    return event.model_dump(mode="json")
