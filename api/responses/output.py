"""A Responses API answer's output items as the model's text streams in (`OutputWriter`):
the assistant message and the function calls, each with its stream events."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from stepline.api.openai.schema import RequestError, call_arguments, template_call
from stepline.api.pipeline.model_output import OutputDelta, OutputSplitter
from stepline.api.responses.schema import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    event_frame,
    flat_name,
)

if TYPE_CHECKING:
    from stepline.api.responses.serving import StoredResponse


class OutputWriter:
    """A response's output items as the model's text streams in: an assistant message for
    its text, a `function_call` item for each tool call (split out by `splitter`), each
    with its stream events. Without tools the message opens at the start (`message_first`);
    with them it opens at the first text, so an answer that only calls tools has only
    function_call items."""

    def __init__(
        self,
        stored: StoredResponse,
        splitter: OutputSplitter,
        *,
        parallel: bool,  # else only the first call is kept
        message_first: bool,  # the message opens at the start (no tools)
        names: dict[str, tuple[str, str]] | None = None,  # flat name -> (namespace, name)
    ):
        self.names = names or {}
        self.resp = stored.response
        self.record = stored.record
        self.splitter = splitter
        self.parallel = parallel
        self.message_first = message_first
        self.message: OutputMessage | None = None
        self.part = OutputText()
        self.calls: dict[int, FunctionCallItem] = {}  # by the call's index in the answer

    def emit(self, event_type: str, **fields: Any) -> None:
        self.record.append_event(event_frame(event_type, len(self.record.frames), **fields))

    def _where(self, item: OutputMessage | FunctionCallItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.resp.output.index(item)}

    def _index(self, item: OutputMessage | FunctionCallItem) -> dict[str, Any]:
        return {"output_index": self.resp.output.index(item), "item": item}

    def open_message(self) -> OutputMessage:
        if self.message is None:
            self.message = OutputMessage(id=f"msg_{uuid.uuid4().hex}")
            self.resp.output = [*self.resp.output, self.message]
            self.emit("response.output_item.added", **self._index(self.message))
            self.message.content = [self.part]
            where = self._where(self.message)
            self.emit("response.content_part.added", **where, content_index=0, part=OutputText())
        return self.message

    def write(self, piece: OutputDelta) -> None:
        """The events of one split piece of the answer (`splitter`'s)."""
        if piece.content:
            where = self._where(self.open_message())
            self.part.text += piece.content
            delta = piece.content
            self.emit(
                "response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[]
            )
        for d in piece.tool_call_deltas:
            if d.index > 0 and not self.parallel:
                continue
            if d.id is not None:
                namespace, name = self.names.get(d.name or "", (None, d.name or ""))
                item = FunctionCallItem(
                    id=f"fc_{uuid.uuid4().hex}", call_id=d.id, name=name, namespace=namespace
                )
                self.calls[d.index] = item
                self.resp.output = [*self.resp.output, item]
                self.emit("response.output_item.added", **self._index(item))
            item = self.calls[d.index]
            if d.arguments:
                item.arguments += d.arguments
                self.emit(
                    "response.function_call_arguments.delta", **self._where(item), delta=d.arguments
                )
            if d.done:
                self._close_call(item, "completed")

    def _close_call(self, item: FunctionCallItem, status: str) -> None:
        if item.status != "in_progress":
            return
        if status == "completed":
            self.emit(
                "response.function_call_arguments.done",
                **self._where(item),
                name=item.name,
                arguments=item.arguments,
            )
        item.status = status  # type: ignore[assignment]
        self.emit("response.output_item.done", **self._index(item))

    def close(self, *, complete: bool) -> None:
        """The answer ended (`complete`: by itself, not at its token limit): close every
        item, with its final events; an answer with no item gets an empty message."""
        if self.message is None and not self.resp.output:
            self.open_message()
        if self.message is not None:
            where = {**self._where(self.message), "content_index": 0}
            self.emit("response.output_text.done", **where, text=self.part.text, logprobs=[])
            self.emit("response.content_part.done", **where, part=self.part)
            self.message.status = "completed" if complete else "incomplete"
            self.emit("response.output_item.done", **self._index(self.message))
        for item in self.calls.values():
            self._close_call(item, "incomplete")  # cut off before its block closed

    def abandon(self) -> None:
        """The answer was cancelled or failed: what it wrote is incomplete (no events)."""
        if self.message is not None:
            self.message.status = "incomplete"
        for item in self.calls.values():
            if item.status == "in_progress":
                item.status = "incomplete"

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the conversation's next message (for `previous_response_id`)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.part.text}
        calls = []
        for c in self.calls.values():
            if c.status == "completed":
                try:
                    arguments = call_arguments(c.arguments, "arguments")
                except RequestError:  # the model's own text: kept as it wrote it
                    arguments = c.arguments
                calls.append(template_call(c.call_id, flat_name(c.namespace, c.name), arguments))
        if calls:
            message["tool_calls"] = calls
        return message
