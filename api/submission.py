"""What `Engine.submit` makes of one request before the step loop sees it: its arguments
checked (`check_submit_args`), its actor (`request_actor`), an embedding's parameters as
recorded (`embedding_record`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stepline.actors.mailbox import Mailbox
from stepline.actors.request import RequestActor
from stepline.api.json_limits import InputLimitError, check_text
from stepline.api.params import SamplingParams
from stepline.api.request_error import RequestError
from stepline.engine.grammar import Compiled
from stepline.events.models import EmbedParams, FinishReason, RequestParams


def embedding_record(embed: EmbedParams) -> RequestParams:
    """An embedding request's parameters: nothing to generate, nothing to sample."""
    return RequestParams(
        max_tokens=0, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, embed=embed
    )


def request_actor(
    rid: str,
    num_prompt_tokens: int,
    params: SamplingParams,
    held: Compiled | None,
    detokenizer: Callable[[], Any],
    send_cancel: Callable[[str, FinishReason], None],
) -> RequestActor:
    """A request's actor. One with stop strings is driven by the step loop, which records
    the end it finds in the step that found it (`RequestActor.take`); any other runs as a
    task of its own and tells the loop of a fault of its own with a `Cancel`."""
    driven = bool(params.stop)
    return RequestActor(
        rid,
        num_prompt_tokens=num_prompt_tokens,
        stop=params.stop,
        detokenizer=detokenizer(),
        inbox=None if driven else Mailbox(),
        output=Mailbox(),
        on_end=(lambda reason: None) if driven else lambda reason: send_cancel(rid, reason),
        keep=held,
    )


MAX_REQUEST_ID_CHARS = 256  # a request id is in every event of its request
MAX_CLIENT_CHARS = 256  # a client is in every request's `admitted` event


def check_submit_args(
    params: Any, request_id: Any, checkpoints: Any, template_kwargs: Any, client: Any = None
) -> None:
    """Raise TypeError / RequestError naming the `submit` argument that is of the wrong type or
    value. Checked before anything reaches the step loop or the event log, where a bad one
    ended the engine (a float checkpoint, a bytes id) or degraded the log (a lone surrogate)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if request_id is not None:
        _check_name(request_id, "request_id", MAX_REQUEST_ID_CHARS)
    if client is not None:
        _check_name(client, "client", MAX_CLIENT_CHARS)
    if isinstance(checkpoints, str | bytes) or not isinstance(checkpoints, Sequence):
        raise TypeError(
            f"checkpoints must be a sequence of token offsets (ints), got "
            f"{type(checkpoints).__name__}"
        )
    for i, c in enumerate(checkpoints):
        if isinstance(c, bool) or not isinstance(c, int):
            raise TypeError(
                f"checkpoints[{i}] must be an int token offset, got {type(c).__name__} {c!r}"
            )
        if c < 0:
            raise RequestError(f"checkpoints[{i}] must be a token offset >= 0, got {c}")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise TypeError(f"template_kwargs must be a dict, got {type(template_kwargs).__name__}")


def _check_name(value: Any, name: str, max_chars: int) -> None:
    """Raise TypeError / RequestError unless `value` is a str of 1 to `max_chars` characters
    that the event log can write."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= max_chars:
        raise RequestError(f"{name} must have 1 to {max_chars} characters, got {len(value)}")
    try:
        check_text(value, name)
    except InputLimitError as exc:
        raise RequestError(exc.message) from None
