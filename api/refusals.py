"""How the server answers each kind of refusal the scheduler core reports
(`actors.scheduler.admission.Refusal`): its HTTP status. The door answers with it
(api/pipeline/errors.py `known_error`) and the core records it in the refused request's
lone `terminal` (`SchedulerCore(refusal_status=...)`), so the log says what the client got.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from stepline.actors.scheduler.admission import Refusal

REFUSAL_STATUS: Mapping[Refusal, int] = MappingProxyType(
    {
        Refusal.QUEUE_FULL: 429,  # try again later (with Retry-After)
    }
)
