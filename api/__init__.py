"""stepline's ways in: the Python async API (`engine`, with `engine_parts`, `arrivals`,
`submission` and `adapters`; `params`, `prompts`, `stream`), the options (`config`), several
models (`pool`), re-execution, and below it the HTTP pipeline, the server, one folder per door
and the CLI.

The top layer: may import everything else of stepline; nothing else imports it.
"""

from stepline.actors.request import RequestOutput
from stepline.actors.scheduler.admission import (
    AdmissionError,
    ContextLengthExceededError,
    EmptyPromptError,
    KVBudgetExceededError,
    QueueFullError,
)
from stepline.actors.step_loop import EngineDeadError
from stepline.api.engine import (
    Engine,
    EngineClosedError,
    RequestStream,
    SamplingParams,
    WrongEventLoopError,
)
from stepline.api.prompts import PromptTooLongError
from stepline.engine.audio import AudioError
from stepline.engine.images import ImageError

__all__ = [
    "AdmissionError",
    "AudioError",
    "ContextLengthExceededError",
    "EmptyPromptError",
    "Engine",
    "EngineClosedError",
    "EngineDeadError",
    "ImageError",
    "KVBudgetExceededError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "WrongEventLoopError",
]
