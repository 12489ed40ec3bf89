"""The LoRA adapters an engine serves: models that share its weights and batch (`engine/lora.py`
holds their matrices, in the runner). Which names a request may ask for, and adapters loaded
while serving, between two steps."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import structlog

from stepline.actors.executor import Executor
from stepline.actors.step_loop import StepLoop
from stepline.api.request_error import RequestError
from stepline.events.models import AdapterLoaded, EmbedParams

log = structlog.get_logger(__name__)


class ServedAdapters(Mapping[str, Any]):
    """An engine's adapters, name -> `engine.lora.AdapterInfo` (the API's copy: the runner
    holds the matrices): those it opened with, and those `load` adds."""

    def __init__(
        self,
        model_name: str,
        adapters: Mapping[str, Any],
        *,
        step_loop: StepLoop,
        executor: Executor,
        config: dict,
    ):
        self._model_name = model_name
        self._adapters = dict(adapters)
        self._step_loop = step_loop
        self._executor = executor
        self._config = config  # the engine's, as recorded
        self._lock = anyio.Lock()

    def __getitem__(self, name: str) -> Any:
        return self._adapters[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)

    def check(self, adapter: str | None, embed: EmbedParams | None) -> None:
        """Raises RequestError (param `model`) for an adapter this engine does not serve."""
        if adapter is None:
            return
        if adapter not in self._adapters:
            served = ", ".join(repr(n) for n in (self._model_name, *self._adapters))
            raise RequestError(f"no LoRA adapter {adapter!r}: served are {served}", param="model")
        if embed is not None:
            raise RequestError("LoRA adapters serve generation, not embeddings", param="model")

    async def load(self, name: str, path: str) -> Any:
        """See `Engine.load_adapter`."""
        async with self._lock:
            if self._config.get("distributed") is not None:
                raise RequestError("LoRA adapters are not supported with parallel")
            if name in self._adapters or name == self._model_name:
                raise RequestError(f"the name {name!r} is served already", param="lora_name")
            runner = self._step_loop.runner
            info = await self._executor.call(runner.load_adapter, name, path)
            self._adapters[name] = info
            self._step_loop.log_model_event(
                AdapterLoaded,
                name=name,
                path=info.path,
                kind=info.kind,
                rank=info.rank,
                num_bytes=info.num_bytes,
            )
            log.info("adapter_loaded", model=self._model_name, name=name, path=path)
            return info
