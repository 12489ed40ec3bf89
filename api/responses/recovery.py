"""After a restart: the /v1/responses responses that the event log says were cut off.

A background response lives in the server's memory; a crash (or the engine shutting down
under it) loses it. Its request is in the event log, though, as an `admitted` event with no
ending (or one that says the engine shut down), so a restarted server with the same
`--event-log` can answer `GET /v1/responses/{id}` with `failed` and the reason, instead of
a 404 (or a client polling forever).
"""

from __future__ import annotations

from pathlib import Path

from stepline.actors.messages import SHUTDOWN_MESSAGE
from stepline.events.log_reader import read_run_events
from stepline.events.models import Admitted, Terminal

RESPONSE_PREFIX = "resp_"


def interrupted_responses(path: str | Path, *, since: float) -> list[tuple[str, float]]:
    """(response id, when it was admitted) of every response the log at `path` admitted at
    or after `since` (a time.time()) that never ended, or that the engine's shutdown ended.
    No log yet: none. Raises what `read_run_events` raises for a corrupt log."""
    admitted: dict[str, float] = {}
    try:
        for _, event in read_run_events(path):
            if isinstance(event, Admitted) and event.request_id.startswith(RESPONSE_PREFIX):
                if event.ts >= since:
                    admitted[event.request_id] = event.ts
            elif isinstance(event, Terminal) and event.request_id in admitted:
                if not (event.reason == "cancelled" and event.message == SHUTDOWN_MESSAGE):
                    del admitted[event.request_id]
    except FileNotFoundError:
        return []
    return sorted(admitted.items(), key=lambda item: item[1])
