"""The one pipeline under every HTTP door (chat, completions, Messages, Responses, Ollama's):
each door translates its request into a `Call` and renders `Piece`s in its wire format; the
rest is here, once, in three parts: intake (api/pipeline/intake.py), start (start.py) and
output (output.py). `Serving` holds them and the server's models, and is what a door sees:

    await serving.handle(request, rid, handler, wire, body=Model)
                        the one error wrapper: the body read and validated, its model
                        acquired, `handler(ctx)` run with the request's `RequestContext`
    started = await serving.start(ctx, Call(...))      the engine request, admitted
    serving.stream(started, renderer, ...)             the one stream writer: frames, pings,
                                                        numbering, disconnects, resume, kept
                                                        streams
    await serving.collect(request, started)            a whole answer, cancelled on disconnect

Clients get stable messages and codes plus the request id, never an exception's text; the
detail goes to the server log under the same id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stepline.api.config import ServerConfig
from stepline.api.pipeline import output
from stepline.api.pipeline.images import PixelBudget
from stepline.api.pipeline.intake import Intake, json_response
from stepline.api.pipeline.output import Output, Piece, Renderer, RequestFailed
from stepline.api.pipeline.resume import ResumeRegistry
from stepline.api.pipeline.served import Models, RequestContext, ServedModel
from stepline.api.pipeline.start import Call, Started, Starter, client_of

__all__ = [
    "Call",
    "Piece",
    "Renderer",
    "RequestContext",
    "RequestFailed",
    "Serving",
    "Started",
    "client_of",
    "json_response",
]


class Serving:
    """The pipeline, for every door of one app: the served models (`Models`, whose every
    model gets its `ServedModel` here), the server's options, the resumable streams' records,
    and the three parts a request goes through."""

    def __init__(
        self,
        models: Models[Any],
        config: ServerConfig,
        interrupted: Sequence[tuple[str, float]] = (),
    ):
        """Raises ValueError for agent options the model cannot honour."""
        self.config = config
        # (request id, admitted at) of what the event log says the last run left unfinished
        # (`responses.recovery`): the Responses door answers those as failed.
        self.interrupted = interrupted
        self.models = models

        budget = PixelBudget(config.max_image_pixels_in_flight)  # one for every model

        def build(engine: Any, names: tuple[str, ...], spec: Any) -> ServedModel:
            return ServedModel(engine, config, names, budget, spec)

        models.attach(build, config.served_model_name)
        self.resume = ResumeRegistry(config.resume_grace_s)
        self.intake = Intake(config, models)
        self.starter = Starter(config)
        self.output = Output(config, self.resume)
        # What a door calls, each the part's own.
        self.handle = self.intake.handle
        self.start = self.starter.start
        self.prepare = self.starter.prepare
        self.with_images = self.starter.with_images
        self.keep = self.output.keep
        self.stream = self.output.stream
        self.collect = output.collect
        self.attached = output.attached
        self.run_kept = output.run_kept
        self.in_background = output.in_background
        self.asks_resumable = output.asks_resumable

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a client may send as `model`."""
        return self.models.names

    @property
    def model_name(self) -> str:
        """The name this server lists first and answers with by default."""
        return self.models.names[0]

    def loaded(self, name: str) -> ServedModel | None:
        """The model `name` names, if it is loaded now."""
        entry = self.models.entry_of(name)
        return entry.served if entry is not None and entry.engine is not None else None
