"""A Responses API answer as the model's text streams in (`ResponseRenderer`): the response
object kept current (status, output items, usage) and each change as a stream event, in the
`openai` package's own types. The events' `sequence_number`s count from 0, one per frame, so
they are the numbers the pipeline's record gives the frames (`id: N`)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from openai.types import responses as sdk
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel
from pydantic_core import to_json

from stepline.api.pipeline.chat import call_arguments, template_call
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.model_output import OutputDelta, OutputSplitter
from stepline.api.pipeline.serving import Piece, RequestFailed
from stepline.api.responses.schema import flat_name

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput

Item = sdk.ResponseOutputMessage | sdk.ResponseFunctionToolCall


def event_frame(event: BaseModel | dict[str, Any]) -> bytes:
    """One stream event: `event: <type>` and its JSON."""
    if isinstance(event, BaseModel):
        data = event.model_dump_json(exclude_unset=True).encode()
        kind = event.type  # type: ignore[attr-defined]
    else:
        data, kind = to_json(event), event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def usage(out: RequestOutput) -> sdk.ResponseUsage:
    return sdk.ResponseUsage(
        input_tokens=out.num_prompt_tokens,
        # Nothing is written for a request as such: the prefix cache keeps what it chooses.
        input_tokens_details=InputTokensDetails(
            cached_tokens=out.num_cached_tokens, cache_write_tokens=0
        ),
        output_tokens=out.num_output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=out.num_prompt_tokens + out.num_output_tokens,
    )


def failure(code: str, message: str) -> sdk.ResponseError:
    # Built unchecked: the SDK's `code` lists OpenAI's codes, ours name what happened here.
    return sdk.ResponseError.model_construct(code=code, message=message)


def failed_response(rid: str, model: str, created_at: float, code: str, message: str):
    """A response that failed with nothing in it but why."""
    return sdk.Response(
        id=rid,
        object="response",
        created_at=int(created_at),
        status="failed",
        background=True,
        model=model,
        output=[],
        parallel_tool_calls=True,
        tool_choice="auto",
        tools=[],
        error=failure(code, message),
    )


class ResponseRenderer:
    """A response's events as the model's text streams in: response.created / .in_progress,
    an assistant message for its text, a `function_call` item for each tool call (split out by
    `splitter`), each with its events, then .completed / .incomplete / .failed / .cancelled.
    Without tools the message opens at the start (`message_first`); with them it opens at the
    first text, so an answer that only calls tools has only function_call items.
    `on_end(message)` gets the answer as the conversation's next message once it ended by
    itself or at its token limit."""

    def __init__(
        self,
        response: sdk.Response,
        splitter: OutputSplitter,
        *,
        parallel: bool,  # else only the first call is kept
        message_first: bool,  # the message opens at the start (no tools)
        names: dict[str, tuple[str, str]] | None = None,  # flat name -> (namespace, name)
        on_end: Any = None,
    ):
        self.resp = response
        self.splitter = splitter
        self.parallel = parallel
        self.message_first = message_first
        self.names = names or {}
        self.on_end = on_end
        self.seq = 0  # the next event's sequence_number
        self.began = False
        self.message: sdk.ResponseOutputMessage | None = None
        self.part = sdk.ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
        self.calls: dict[int, sdk.ResponseFunctionToolCall] = {}  # by the call's index
        self.last: RequestOutput | None = None

    # -- the pipeline's renderer --

    def frames(self, piece: Piece) -> bytes:
        out: list[bytes] = self._begin()
        if piece.is_progress:
            return b"".join(out)
        self.last = piece.out
        out += self._write(piece.delta)
        reason = piece.out.finish_reason
        if reason is not None:
            out += self._end(complete=reason == "stop")
        return b"".join(out)

    def failed(self, err: APIError) -> bytes:
        out = self._begin()
        if isinstance(err, RequestFailed):
            self.last = err.out
            if err.out.finish_reason == "cancelled":
                return b"".join(out + self._cancelled())
        self._set_usage()
        self.resp.status = "failed"
        self._abandon()
        self.resp.error = failure(err.code or "server_error", err.message)
        out.append(self._emit("response.failed", sdk.ResponseFailedEvent, response=self.resp))
        return b"".join(out)

    def cancelled(self, err: APIError) -> bytes:
        return b"".join(self._begin() + self._cancelled())

    # -- events --

    def _emit(self, kind: str, cls: type[BaseModel] | None = None, **fields: Any) -> bytes:
        """Event `kind` (of SDK class `cls`; None for a type the SDK has no class for)."""
        n, self.seq = self.seq, self.seq + 1
        if cls is None:
            body: dict[str, Any] = {"type": kind, "sequence_number": n}
            for name, value in fields.items():
                body[name] = value.model_dump(exclude_unset=True, mode="json")
            return event_frame(body)
        return event_frame(cls(type=kind, sequence_number=n, **fields))

    def _begin(self) -> list[bytes]:
        if self.began:
            return []
        self.began = True
        out = [self._emit("response.created", sdk.ResponseCreatedEvent, response=self.resp)]
        self.resp.status = "in_progress"
        out.append(
            self._emit("response.in_progress", sdk.ResponseInProgressEvent, response=self.resp)
        )
        if self.message_first:
            out += self._open_message()
        return out

    def _where(self, item: Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.resp.output.index(item)}

    def _index(self, item: Item) -> dict[str, Any]:
        return {"output_index": self.resp.output.index(item), "item": item}

    def _open_message(self) -> list[bytes]:
        if self.message is not None:
            return []
        self.message = sdk.ResponseOutputMessage(
            id=f"msg_{uuid.uuid4().hex}",
            type="message",
            role="assistant",
            status="in_progress",
            content=[],
        )
        self.resp.output = [*self.resp.output, self.message]
        out = [
            self._emit(
                "response.output_item.added",
                sdk.ResponseOutputItemAddedEvent,
                **self._index(self.message),
            )
        ]
        self.message.content = [self.part]
        empty = self.part.model_copy()
        out.append(
            self._emit(
                "response.content_part.added",
                sdk.ResponseContentPartAddedEvent,
                **self._where(self.message),
                content_index=0,
                part=empty,
            )
        )
        return out

    def _write(self, piece: OutputDelta) -> list[bytes]:
        """The events of one split piece of the answer (`splitter`'s)."""
        out: list[bytes] = []
        if piece.content:
            out += self._open_message()
            assert self.message is not None
            self.part.text += piece.content
            out.append(
                self._emit(
                    "response.output_text.delta",
                    sdk.ResponseTextDeltaEvent,
                    **self._where(self.message),
                    content_index=0,
                    delta=piece.content,
                    logprobs=[],
                )
            )
        for d in piece.tool_call_deltas:
            if d.index > 0 and not self.parallel:
                continue
            if d.id is not None:
                namespace, name = self.names.get(d.name or "", (None, d.name or ""))
                item = sdk.ResponseFunctionToolCall(
                    id=f"fc_{uuid.uuid4().hex}",
                    type="function_call",
                    call_id=d.id,
                    name=name,
                    arguments="",
                    status="in_progress",
                    namespace=namespace,
                )
                self.calls[d.index] = item
                self.resp.output = [*self.resp.output, item]
                out.append(
                    self._emit(
                        "response.output_item.added",
                        sdk.ResponseOutputItemAddedEvent,
                        **self._index(item),
                    )
                )
            item = self.calls[d.index]
            if d.arguments:
                item.arguments += d.arguments
                out.append(
                    self._emit(
                        "response.function_call_arguments.delta",
                        sdk.ResponseFunctionCallArgumentsDeltaEvent,
                        **self._where(item),
                        delta=d.arguments,
                    )
                )
            if d.done:
                out += self._close_call(item, "completed")
        return out

    def _close_call(self, item: sdk.ResponseFunctionToolCall, status: str) -> list[bytes]:
        if item.status != "in_progress":
            return []
        out = []
        if status == "completed":
            out.append(
                self._emit(
                    "response.function_call_arguments.done",
                    sdk.ResponseFunctionCallArgumentsDoneEvent,
                    **self._where(item),
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        item.status = status  # type: ignore[assignment]
        out.append(
            self._emit(
                "response.output_item.done", sdk.ResponseOutputItemDoneEvent, **self._index(item)
            )
        )
        return out

    def _end(self, *, complete: bool) -> list[bytes]:
        """The answer ended (`complete`: by itself, not at its token limit): close every
        item with its final events (an answer with no item gets an empty message), then the
        response's last event."""
        out: list[bytes] = []
        if self.message is None and not self.resp.output:
            out += self._open_message()
        if self.message is not None:
            where = {**self._where(self.message), "content_index": 0}
            out.append(
                self._emit(
                    "response.output_text.done",
                    sdk.ResponseTextDoneEvent,
                    **where,
                    text=self.part.text,
                    logprobs=[],
                )
            )
            out.append(
                self._emit(
                    "response.content_part.done",
                    sdk.ResponseContentPartDoneEvent,
                    **where,
                    part=self.part,
                )
            )
            self.message.status = "completed" if complete else "incomplete"
            out.append(
                self._emit(
                    "response.output_item.done",
                    sdk.ResponseOutputItemDoneEvent,
                    **self._index(self.message),
                )
            )
        for item in self.calls.values():
            out += self._close_call(item, "incomplete")  # cut off before its block closed
        self._set_usage()
        if complete:
            self.resp.status = "completed"
            self.resp.completed_at = int(time.time())
            out.append(
                self._emit("response.completed", sdk.ResponseCompletedEvent, response=self.resp)
            )
        else:
            self.resp.status = "incomplete"
            self.resp.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            out.append(
                self._emit("response.incomplete", sdk.ResponseIncompleteEvent, response=self.resp)
            )
        if self.on_end is not None:
            self.on_end(self.assistant_message())
        return out

    def _cancelled(self) -> list[bytes]:
        self._set_usage()
        self.resp.status = "cancelled"
        self._abandon()
        return [self._emit("response.cancelled", response=self.resp)]

    def _set_usage(self) -> None:
        if self.last is not None:
            self.resp.usage = usage(self.last)

    def _abandon(self) -> None:
        """The answer was cancelled or failed: what it wrote is incomplete (no events)."""
        if self.message is not None:
            self.message.status = "incomplete"
        for item in self.calls.values():
            if item.status == "in_progress":
                item.status = "incomplete"

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the conversation's next message (for `previous_response_id`): its
        text and its calls, a call cut off by the token limit with the arguments it got."""
        message: dict[str, Any] = {"role": "assistant", "content": self.part.text}
        calls = []
        for c in self.calls.values():
            try:
                arguments = call_arguments(c.arguments, "arguments")
            except APIError:  # the model's own text past the body's limits: kept as it is
                arguments = c.arguments
            calls.append(template_call(c.call_id, flat_name(c.namespace, c.name), arguments))
        if calls:
            message["tool_calls"] = calls
        return message
