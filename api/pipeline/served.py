"""Which model serves a request.

- `ServedModel`: one served model's part of the pipeline: its engine, the names clients send
  for it, and what the server's options make of its tokenizer (chat template, reasoning tags,
  template arguments, whether it reads images).
- `Models`: what the pipeline asks of the server's models. A server of several is a
  `ModelPool` (api/pool.py, which builds a `ServedModel` as each model loads); a single
  `--model` is `OneModel`, a pool of one pinned model that is loaded already.
- `RequestContext`: one request as its door's handler and renderers get it, as an argument:
  the HTTP request, its id, its parsed body and the model serving it (acquired once its body
  is parsed, `pipeline.intake`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from stepline.api.config import ModelSpec, ServerConfig
from stepline.api.defaults import ModelDefaults, resolve
from stepline.api.pipeline.agents import configure
from stepline.api.pipeline.audio import AudioOptions
from stepline.api.pipeline.images import ImageOptions, PixelBudget
from stepline.engine.audio import AudioLimits
from stepline.engine.images import ImageLimits

if TYPE_CHECKING:
    from fastapi import Request
    from prometheus_client.core import Metric

    from stepline.api.engine import Engine
    from stepline.events.feed import EventFeed


class ServedModel:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        names: tuple[str, ...] = (),
        pixel_budget: PixelBudget | None = None,
        spec: ModelSpec | None = None,
    ):
        """Raises ValueError for agent options (`--chat-template`, `--reasoning-parser`, ...)
        the model cannot honour. `pixel_budget`: the server's, shared by its models. `spec`:
        its entry in a server of several (its own defaults)."""
        self.engine = engine
        self.names: tuple[str, ...] = names or (engine.model_name,)
        self.defaults = model_defaults(engine, config, spec)
        vision = getattr(engine.prompts, "images", None)
        self.images = ImageOptions(
            accepts_images=engine.accepts_images,
            allow_urls=config.allow_image_urls,
            fetch_timeout_s=config.image_fetch_timeout_s,
            limits=ImageLimits(
                config.max_image_bytes, config.max_image_pixels, config.max_images_per_request
            ),
            expand=None if vision is None else vision.expand,
            budget=pixel_budget or PixelBudget(config.max_image_pixels_in_flight),
        )
        hearing = getattr(engine.prompts, "audio", None)
        self.audio = AudioOptions(
            accepts_audio=hearing is not None,
            limits=AudioLimits(
                config.max_audio_bytes,
                config.max_audio_seconds,
                config.max_audio_sample_rate,
                config.max_audios_per_request,
            ),
            rate=getattr(hearing, "rate", 16_000),
            expand=None if hearing is None else hearing.expand,
        )
        # Applies --chat-template to the tokenizer.
        self.reasoning, self.default_template_kwargs = configure(
            engine.tokenizer,
            reasoning_parser=config.reasoning_parser,
            chat_template=config.chat_template,
            default_chat_template_kwargs=config.default_chat_template_kwargs,
        )
        self._token_text: dict[int, str] = {}
        self.door_facts: dict[str, Any] = {}  # what a door read once about the model

    @property
    def name(self) -> str:
        """The name it is listed by."""
        return self.names[0]

    def token_text(self, token_id: int) -> str:
        """One token's text (as logprobs show it), decoded once."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text


def model_defaults(engine: Engine, config: ServerConfig, spec: ModelSpec | None) -> ModelDefaults:
    """The defaults in effect for `engine`'s model (api/defaults.py): `spec`'s over its
    generation_config.json's (a GGUF file has none: its converted directory holds none)."""
    path = getattr(getattr(engine, "loaded", None), "path", None)
    mode = (spec.generation_config if spec is not None else None) or config.generation_config
    return resolve(
        None if path is None else Path(path),
        generation_config=mode,
        own=spec.sampling if spec is not None else None,
        own_max_tokens=spec.default_max_tokens if spec is not None else None,
        server_max_tokens=config.default_max_tokens,
    )


# What builds a model's `ServedModel` as it loads: (its engine, the names it is served by,
# its entry in a server of several: None for a single `--model`).
Build = Callable[["Engine", tuple[str, ...], ModelSpec | None], ServedModel]


class ModelEntry(Protocol):
    """One model of `Models`: its engine while it is loaded, and its `ServedModel`."""

    engine: Engine | None
    served: Any  # its `ServedModel` (`Models.attach`) while loaded

    @property
    def name(self) -> str: ...

    def keep_loaded(self, seconds: float | None) -> None:
        """How long it stays loaded once idle (None: forever), where models unload (a pool);
        a request's keep_alive (Ollama's)."""
        ...

    def expires_at(self) -> float | None:
        """When (time.time()) it is unloaded if no request comes; None: never."""
        ...


_E = TypeVar("_E", bound=ModelEntry)


class Models(Protocol[_E]):
    """The server's models, as the pipeline uses them (`ModelPool`, `OneModel`)."""

    @property
    def on_demand(self) -> bool:
        """Whether models load when asked for (a model card then says if it is loaded)."""
        ...

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may send as `model`; the first is the default."""
        ...

    @property
    def listed(self) -> tuple[str, ...]:
        """Each model's first name, as /v1/models lists them."""
        ...

    def entry_of(self, name: str) -> _E | None: ...

    def loaded(self) -> Sequence[_E]: ...

    def attach(self, build: Build, rename: tuple[str, ...]) -> None:
        """Build each model's `ServedModel`: now for those loaded, later as others load.
        `rename`: `--served-model-name`, the names of a server of one model."""
        ...

    def expect(self) -> _E | None:
        """A request's body is read: acquired now (`acquire`, counted as arriving) when its
        model is known before the body says (a server of one model); else None."""
        ...

    def must_wait(self, name: str) -> bool:
        """Whether `acquire(name)` waits for a load (a stream starts meanwhile)."""
        ...

    async def acquire(self, name: str) -> _E:
        """The model `name` names, loaded; it stays loaded until `release`. Raises as
        `ModelPool.acquire` does."""
        ...

    def release(self, entry: _E) -> None:
        """The request that acquired `entry` is in its engine, or failed: its arrival ends."""
        ...

    def adapter_loaded(self, entry: _E, num_bytes: int) -> None:
        """A LoRA adapter of `num_bytes` was loaded into `entry`'s model (its footprint)."""
        ...

    def log_refusal(
        self, request_id: str, message: str, *, code: str, status: int, model: str | None
    ) -> None:
        """Record a request a door refused before it reached an engine (`Engine.log_refusal`),
        under `model` (the one it acquired), or under the run (None)."""
        ...

    def health(self, *, detail: bool) -> dict[str, Any]:
        """/health's body (`status`: "unhealthy" for a 503); `detail`: an exception's text
        (for a caller with the API key)."""
        ...

    def collect(self) -> Iterable[Metric]:
        """The models' metrics (a prometheus_client collector)."""
        ...

    @property
    def feed(self) -> EventFeed | None:
        """The run's events for live readers (`GET /v1/events`), every model's."""
        ...

    def begin_shutdown(self) -> int: ...


@dataclass
class OnlyEntry:
    """`OneModel`'s entry: its engine, always loaded."""

    engine: Engine
    served: Any = None

    @property
    def name(self) -> str:
        return self.served.name if self.served is not None else self.engine.model_name

    def keep_loaded(self, seconds: float | None) -> None:
        pass  # a single model is never unloaded

    def expires_at(self) -> float | None:
        return None


class OneModel:
    """A pool of one pinned model: a single `--model`'s engine, open already, under its name
    (or `--served-model-name`'s). Its requests count as arriving from when their body is read
    (`expect`), and its /health and /metrics are its engine's, unlabelled."""

    on_demand = False

    def __init__(self, engine: Engine):
        self.engine = engine
        self.entry = OnlyEntry(engine)

    @property
    def names(self) -> tuple[str, ...]:
        served = self.entry.served
        own = served.names if served is not None else (self.engine.model_name,)
        return (*own, *self.engine.adapters)  # its LoRA adapters are models too

    @property
    def listed(self) -> tuple[str, ...]:
        return (self.names[0], *self.engine.adapters)

    def entry_of(self, name: str) -> OnlyEntry | None:
        return self.entry if name in self.names else None

    def loaded(self) -> list[OnlyEntry]:
        return [self.entry]

    def attach(self, build: Build, rename: tuple[str, ...]) -> None:
        self.entry.served = build(self.engine, rename or (self.engine.model_name,), None)

    def expect(self) -> OnlyEntry:
        self.engine.arriving()  # until it is submitted, or the request's handler ends
        return self.entry

    def must_wait(self, name: str) -> bool:
        return False

    async def acquire(self, name: str) -> OnlyEntry:
        return self.entry

    def release(self, entry: OnlyEntry) -> None:
        self.engine.arrived()

    def adapter_loaded(self, entry: OnlyEntry, num_bytes: int) -> None:
        pass  # a single model's memory is not budgeted against others

    def log_refusal(
        self, request_id: str, message: str, *, code: str, status: int, model: str | None
    ) -> None:
        self.engine.log_refusal(request_id, message, code=code, status=status)

    @property
    def feed(self) -> EventFeed | None:
        return self.engine.step_loop.feed

    def health(self, *, detail: bool) -> dict[str, Any]:
        engine = self.engine
        if engine.healthy:
            body: dict[str, Any] = {"status": "ok", "model": self.names[0]}
            if engine.warming_up:
                body["warming_up"] = True  # serving; step times learned, not yet measured
            if (problem := engine.event_log_problem) is not None:
                # Still serving (200), but the record of what it serves is lost: say so.
                body.update(status="degraded", event_log=problem)
            return body
        reason = engine.unhealthy_reason or "the engine is shut down"
        if not detail:  # what broke, but its detail (an exception's text) only with the key
            reason = reason.split(":", 1)[0] + " (send the API key for the detail)"
        return {"status": "unhealthy", "reason": reason}

    def collect(self) -> Iterable[Metric]:
        return self.engine.metrics.registry.collect()

    def begin_shutdown(self) -> int:
        return self.engine.begin_shutdown()


_R = TypeVar("_R")


@dataclass
class RequestContext(Generic[_R]):
    """One request, as a door's handler (and its renderers) get it: `request`, its id `rid`,
    its parsed `body`, and `model`, the model serving it (`entry`'s, acquired until the
    handler ends). The model is held weakly: a context outlives its request (a kept stream's
    record, a stored response), and must not keep an unloaded model's memory; the model is
    loaded while its request runs."""

    request: Request
    rid: str
    body: _R
    entry: ModelEntry = field(repr=False)
    arrived_at: float = field(default_factory=time.time)  # time.time() when it came
    _served: Callable[[], ServedModel | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._served = weakref.ref(self.entry.served)

    @property
    def model(self) -> ServedModel:
        served = self._served()
        if served is None:
            raise RuntimeError("the request's model was unloaded after the request ended")
        return served

    @property
    def engine(self) -> Engine:
        return self.model.engine

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the request names as its `model` (one its model serves), or None:
        the model itself."""
        requested = getattr(self.body, "model", None)
        return requested if requested in self.engine.adapters else None

    @property
    def response_model(self) -> str:
        """The `model` of a response: the name the client asked for (a served one), else the
        model's."""
        requested = getattr(self.body, "model", None)
        return requested if requested is not None else self.model.name
