"""Which model serves a request.

- `ServedModel`: one served model's part of the pipeline: its engine, the names clients send
  for it, and what the server's options make of its tokenizer (chat template, reasoning tags,
  template arguments, whether it reads images).
- `ServedModels`: the server's models, one or a pool of several (api/pool.py, which builds a
  `ServedModel` as each model loads), and the binding of a request to its model: `bind` (when
  its body is parsed: the model loaded first) puts it in the request task's context, where the
  door's handler and renderers read it (`current`); `unbind` (when the handler ends) lets a
  pool unload the model once nothing needs it.
"""

from __future__ import annotations

import time
import weakref
from contextvars import Context, ContextVar
from typing import TYPE_CHECKING, Any

import anyio

from stepline.api.config import ServerConfig
from stepline.api.pipeline.agents import configure
from stepline.api.pipeline.errors import APIError, model_not_found
from stepline.api.pipeline.images import ImageOptions, PixelBudget
from stepline.engine.images import ImageLimits

if TYPE_CHECKING:
    from stepline.api.engine import Engine
    from stepline.api.pool import ModelPool


class ServedModel:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        names: tuple[str, ...] = (),
        pixel_budget: PixelBudget | None = None,
    ):
        """Raises ValueError for agent options (`--chat-template`, `--reasoning-parser`, ...)
        the model cannot honour. `pixel_budget`: the server's, shared by its models."""
        self.engine = engine
        self.names: tuple[str, ...] = names or (engine.model_name,)
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


class _Binding:
    """A request's model, bound to its task by `ServedModels.bind`. It holds the model weakly:
    a context outlives its request (a cancelled timer keeps it until its time), and must not
    keep an unloaded model's memory; the model is loaded while its request runs."""

    def __init__(self, served: ServedModel, entry: Any = None):
        self._served = weakref.ref(served)
        self.entry = entry  # its pool entry (a server of several models), released once
        self.released = False

    @property
    def served(self) -> ServedModel:
        served = self._served()
        if served is None:
            raise RuntimeError("the request's model was unloaded after the request ended")
        return served


# The model of the request this task serves (`ServedModels.bind`).
_BOUND: ContextVar[_Binding | None] = ContextVar("stepline_served_model", default=None)
# Set by `bind` when a streamed request waits for its model to load (`Serving.handle` then
# starts its stream and pings meanwhile).
_LOADING: ContextVar[anyio.Event | None] = ContextVar("stepline_model_loading", default=None)


def watch_loading() -> anyio.Event:
    """An event `bind` sets, in this context, when its streamed request must wait for its
    model to load."""
    loading = anyio.Event()
    _LOADING.set(loading)
    return loading


def adopt_binding(ctx: Context) -> None:
    """Bind the model `ctx` bound (a handler's task) in this task's context too."""
    _BOUND.set(ctx.get(_BOUND))


class ServedModels:
    """The server's models: one engine's, or a pool's (built as they load)."""

    def __init__(self, engine: Engine | ModelPool, config: ServerConfig):
        self.pool: ModelPool | None = None
        self.one: ServedModel | None = None
        budget = PixelBudget(config.max_image_pixels_in_flight)  # one for every model
        if hasattr(engine, "acquire"):  # several models (api/pool.py)
            pool: ModelPool = engine  # type: ignore[assignment]

            def build(engine: Engine, spec: Any) -> ServedModel:
                return ServedModel(engine, config, spec.names, budget)

            pool.on_load = build
            for entry in pool.loaded():  # loaded before the app existed (pinned ones)
                entry.served = build(entry.engine, entry.spec)
            self.pool = pool
        else:
            names = config.served_model_name or (engine.model_name,)  # type: ignore[union-attr]
            self.one = ServedModel(engine, config, names, budget)  # type: ignore[arg-type]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may send as `model`."""
        if self.pool is not None:
            return self.pool.names
        assert self.one is not None
        return self.one.names

    @property
    def listed_names(self) -> tuple[str, ...]:
        """Each model's first name, as /v1/models lists them."""
        if self.pool is not None:
            return tuple(self.pool.entries)
        assert self.one is not None
        return (self.one.name,)

    def loaded(self, name: str) -> ServedModel | None:
        """The model `name` names, if it is loaded now."""
        if self.pool is None:
            return self.one if self.one is not None and name in self.one.names else None
        entry = self.pool.entry_of(name)
        return entry.served if entry is not None and entry.engine is not None else None

    def check(self, model: str | None) -> None:
        """Raises APIError 404 if `model` is given and not a name this server serves."""
        if model is not None and model not in self.names:
            raise model_not_found(model, ", ".join(repr(n) for n in self.names))

    def log_refusal(self, request_id: str, message: str, *, code: str, status: int) -> None:
        """Record in the event log a request a door refused before it reached its engine
        (`Engine.log_refusal`): in a pool, under the model this task's request is bound to
        (`bind`), else under the run (`ModelPool.log_refusal`)."""
        if self.pool is None:
            assert self.one is not None
            self.one.engine.log_refusal(request_id, message, code=code, status=status)
            return
        binding = _BOUND.get()
        entry = binding.entry if binding is not None else None
        name = entry.spec.name if entry is not None else None
        self.pool.log_refusal(request_id, message, code=code, status=status, model=name)

    @property
    def current(self) -> ServedModel:
        """The model of the request this task serves (`bind`); a server of one model's."""
        binding = _BOUND.get()
        if binding is not None:
            return binding.served
        if self.one is None:
            raise RuntimeError("no model is bound to this task: parse the request first")
        return self.one

    async def bind(self, requested: str | None, *, streams: bool = False) -> ServedModel:
        """Bind the model `requested` names (None: the first one) to this task's request,
        loading it first in a server of several models (the caller waits meanwhile; a request
        that `streams` gets its stream's pings meanwhile, see `Serving.handle`); it stays
        loaded until the request is in its engine (`unbind`). Raises APIError: 404 for a name
        no model has, 400 for a model larger than the memory budget, 503 for one whose load
        failed."""
        self.check(requested)
        if self.pool is None:
            assert self.one is not None
            _BOUND.set(_Binding(self.one))
            return self.one
        from stepline.api.pool import ModelState, ModelTooLargeError, ModelUnavailableError

        name = requested or self.names[0]
        entry = self.pool.entry_of(name)
        loading = _LOADING.get()
        if streams and loading is not None and entry is not None and entry.refused is None:
            failed = entry.state is ModelState.FAILED and time.monotonic() < entry.retry_at
            if entry.state is not ModelState.LOADED and not failed:
                loading.set()  # the stream starts now, and pings until the model is loaded
        try:
            entry = await self.pool.acquire(name)
        except ModelTooLargeError as exc:
            raise APIError(400, str(exc), param="model", code="model_too_large") from None
        except ModelUnavailableError as exc:
            raise APIError(
                503, str(exc), code="model_unavailable", headers={"retry-after": "5"}
            ) from None
        _BOUND.set(_Binding(entry.served, entry))
        return entry.served

    def unbind(self) -> None:
        """The end of a request's handler: a request that did not reach its engine is no
        longer arriving, and a pool's model may be unloaded once its requests are all in it
        (or ended)."""
        binding = _BOUND.get()
        if binding is not None and binding.entry is not None:
            if not binding.released and self.pool is not None:
                binding.released = True
                self.pool.release(binding.entry)  # its arrival ends there too
        elif self.one is not None:
            self.one.engine.arrived()
