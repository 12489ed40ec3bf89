"""Each served model's default sampling: what a request that leaves a parameter out gets.

Layers, the first that sets a parameter wins (`resolve`, `Starter.sampling`):
1. the request's own value;
2. the model's entry in the models file (`temperature = 0.6`, ...: a `ModelSpec`'s `sampling`);
3. the model's `generation_config.json` (its authors' recommendation, as vLLM's
   `--generation-config auto` reads it), unless `--generation-config none`;
4. a door's own documented defaults (Ollama's `DefaultOptions`; none for the others);
5. the engine's built-in ones (`SamplingParams`: temperature 1, top-p 1, no top-k, ...).

The output cap is the request's `max_tokens`, else the model's entry's `default_max_tokens`,
else `--default-max-tokens`, else the model's `max_new_tokens`, else 4,096: a client that sends
no cap gets an answer that ends by itself; the whole context only for a request asking for
it. No MLX here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepline.engine.sampling_limits import MAX_INT32, MAX_REPETITION_PENALTY

log = structlog.get_logger(__name__)

DEFAULT_MAX_TOKENS = 4096  # a chat answer's cap when neither the request nor the model says
GENERATION_CONFIG = "generation_config.json"
GenerationConfigMode = Literal["auto", "none"]


class SamplingDefaults(BaseModel):
    """Default values of the sampling parameters a model may recommend; None: not set here (a
    lower layer's applies)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT32, description="0: off")
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)

    def values(self) -> dict[str, Any]:
        """The parameters this layer sets, by their engine names."""
        return self.model_dump(exclude_none=True)

    def over(self, below: SamplingDefaults) -> SamplingDefaults:
        """This layer's values over `below`'s."""
        return SamplingDefaults(**{**below.values(), **self.values()})


SAMPLING_KEYS = tuple(SamplingDefaults.model_fields)


class ModelDefaults(BaseModel):
    """A served model's defaults in effect: its sampling (every layer above the door's and
    the engine's, merged) and its output cap. `/v1/models` and Ollama's `/api/show` report
    them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sampling: SamplingDefaults = SamplingDefaults()
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    source: str = "server"  # where the sampling came from, for the model cards

    def card(self) -> dict[str, Any]:
        return {**self.sampling.values(), "max_tokens": self.max_tokens, "source": self.source}


def read_generation_config(model_dir: Path) -> tuple[SamplingDefaults, int | None]:
    """The sampling and `max_new_tokens` of `model_dir`'s generation_config.json (none when
    it has no such file). A value out of range is left out, with a warning: a model's file
    must not stop it from being served. `do_sample` is not read (as vLLM does not): a file
    that names a temperature recommends it."""
    path = model_dir / GENERATION_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SamplingDefaults(), None
    except (OSError, ValueError) as exc:
        log.warning("generation_config_unreadable", path=str(path), error=str(exc))
        return SamplingDefaults(), None
    if not isinstance(data, dict):
        return SamplingDefaults(), None
    kept: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = data.get(key)
        if value is None:
            continue
        try:
            SamplingDefaults(**{key: value})
        except ValidationError:
            log.warning("generation_config_value_ignored", path=str(path), key=key, value=value)
            continue
        kept[key] = value
    max_new = data.get("max_new_tokens")
    if not (isinstance(max_new, int) and not isinstance(max_new, bool) and max_new >= 1):
        max_new = None
    return SamplingDefaults(**kept), max_new


def resolve(
    model_dir: Path | None,
    *,
    generation_config: GenerationConfigMode = "auto",
    own: SamplingDefaults | None = None,
    own_max_tokens: int | None = None,
    server_max_tokens: int | None = None,
) -> ModelDefaults:
    """A model's defaults in effect: `own` (its models-file entry) over its
    generation_config.json (read from `model_dir` unless `generation_config` is "none"); its
    cap `own_max_tokens`, else `server_max_tokens` (`--default-max-tokens`), else the file's
    `max_new_tokens`, else DEFAULT_MAX_TOKENS."""
    read, max_new = SamplingDefaults(), None
    if generation_config == "auto" and model_dir is not None:
        read, max_new = read_generation_config(model_dir)
    sampling = (own or SamplingDefaults()).over(read)
    sources = []
    if own is not None and own.values():
        sources.append("models file")
    if read.values():
        sources.append(GENERATION_CONFIG)
    cap = own_max_tokens or server_max_tokens or max_new or DEFAULT_MAX_TOKENS
    return ModelDefaults(
        sampling=sampling, max_tokens=cap, source=" over ".join(sources) or "server"
    )
