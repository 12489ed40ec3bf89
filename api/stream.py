"""A request's output stream, as the Python API hands it out."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from stepline.actors.mailbox import Mailbox
from stepline.actors.messages import SHUTDOWN_MESSAGE
from stepline.actors.request import RequestOutput
from stepline.events.models import RequestParams


class RequestStream:
    """The outputs of one request, and its `params` as admitted. Async-iterate it;
    `aclose()` (or `async with`) cancels it. A reader that fell behind gets the outputs that
    piled up as one (`RequestOutput.then`)."""

    def __init__(
        self,
        request_id: str,
        outputs: Mailbox[RequestOutput],
        cancel: Callable,
        params: RequestParams | None = None,
    ):
        self.request_id = request_id
        # As the engine admitted it (`Engine.submit`): `max_tokens` as resolved, the limit
        # it runs to and the one a door reports.
        self.params = params
        self._outputs = outputs
        self._cancel = cancel
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._outputs.get()
        except anyio.EndOfStream:
            self.finished = True
            self._outputs.close()
            raise StopAsyncIteration from None
        while out.finish_reason is None and self._outputs.pending:  # it fell behind
            out = out.then(self._outputs.get_nowait())
        if out.finish_reason is not None:
            self.finished = True
            self._outputs.close()
        return out

    async def aclose(self, *, shutdown: bool = False) -> None:
        """Cancel it, if still running: as the client's cancel, or (`shutdown`) as one the
        server's stop made (its log says so, and a background response is recovered)."""
        if not self.finished:
            self.finished = True
            self._cancel(SHUTDOWN_MESSAGE) if shutdown else self._cancel()
        self._outputs.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self.finished:  # dropped without being read to the end: cancel it
            self.finished = True
            try:
                self._cancel()
            except Exception:  # noqa: BLE001 - the engine may be gone already
                pass
        self._outputs.close()
