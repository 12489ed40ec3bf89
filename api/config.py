"""Every option, with its default and its meaning, written once, in typed models.

- `EngineConfig`: how an engine schedules, remembers and budgets. `Engine.open(...)` takes its
  fields as keyword arguments and validates them here; the event log's header records one
  (plus what the engine resolved, such as the measured KV budget in tokens), and
  `stepline replay --reexecute` reads it back to open an engine configured the same way.
- `EventLogConfig`: where the event log goes and what it keeps (also `Engine.open` keywords;
  never recorded, so re-execution never writes into the log it reads).
- `ServerConfig`: how `stepline serve` serves HTTP (`create_app` takes its fields as keywords).
- `ModelSpec`, `PoolConfig`: a server of several models (api/pool.py): each model by name, and
  the memory and idle time that decide which stay loaded (`--model NAME=PATH`, `--models FILE`).

The command line's flags are made from these fields (`api/cli/flags.py`): a flag's default
and help are its field's. No MLX here.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from stepline.actors.scheduler.drafter import SpeculativeConfig, parse_speculative_config
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.api.defaults import SAMPLING_KEYS, GenerationConfigMode, SamplingDefaults
from stepline.engine.audio import (
    MAX_AUDIO_BYTES,
    MAX_AUDIO_SAMPLE_RATE,
    MAX_AUDIO_SECONDS,
    MAX_AUDIOS_PER_REQUEST,
)
from stepline.engine.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
    MAX_PIXELS_IN_FLIGHT,
)
from stepline.events.feed import DEFAULT_CAPACITY

# The scheduler's defaults are its own (`SchedulerConfig`); the options read them.
_SCHEDULER = SchedulerConfig()


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineConfig(_Options):
    """How an engine schedules, remembers and budgets."""

    dtype: Literal["auto", "float32", "bfloat16", "float16", "keep"] = Field(
        "auto",
        description="the weights' dtype: auto keeps them as stored on a GPU (Metal, CUDA) and "
        "makes them float32 on the CPU backend, where quantized and 16-bit matmuls are ~17-20x "
        "slower; keep: as stored; or dequantize and cast to the dtype named",
    )
    max_step_tokens: int = Field(
        _SCHEDULER.max_step_tokens, ge=1, description="token budget of one step"
    )
    max_num_seqs: int = Field(
        _SCHEDULER.max_num_seqs, ge=1, description="most requests running at once"
    )
    long_prefill_cap: int | None = Field(
        None, ge=1, description="most prompt tokens one request gets per step (default: the budget)"
    )
    max_step_ms: float | None = Field(
        _SCHEDULER.max_step_ms,
        ge=0,
        description="target time of a step while requests decode: prefill chunks are sized to "
        "keep each step under it, by a step-time model learned online (0: tokens only)",
    )
    max_kv_tokens: int | None = Field(
        None, ge=1, description="the same KV budget in tokens (instead of in GB)"
    )
    max_kv_gb: float | None = Field(
        None,
        gt=0,
        description="memory for running requests' KV (prompt + max_tokens each, plus the room "
        "a KV buffer may grow past them); requests wait for room, one that can never fit is "
        "refused (default: 70% of memory less the weights and the prefix cache)",
    )
    kv_bits: Literal[4, 8] | None = Field(
        None,
        description="hold running requests' KV (and the prefix cache's) quantized to this many "
        "bits a number, in groups of kv_group_size with a scale and bias each: 8 bits take about "
        "half the memory of 16-bit KV, 4 about a quarter (of float32 KV, on the CPU: 0.28 and "
        "0.16); recurrent and sliding-window layers stay as they are (default: unquantized)",
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        64,
        description="numbers of a head's vector that share one scale and bias under kv_bits "
        "(it must divide the model's head width)",
    )
    max_waiting: int = Field(
        _SCHEDULER.max_waiting,
        ge=1,
        description="most requests waiting to start; past it new ones are refused (429)",
    )
    mlx_cache_gb: float | None = Field(
        None,
        ge=0,
        description="limit of MLX's buffer cache (freed memory kept for reuse; default: 10% of "
        "memory, at most 0.5)",
    )
    grammar_cache_mb: float = Field(
        256.0,
        ge=0,
        description="memory for compiled grammars (structured output, forced tool calls) kept "
        "for reuse, as estimated from each grammar's size and the vocabulary",
    )
    seed: int = Field(0, description="the engine's sampling seed for requests that set none")
    prefix_cache_gb: float = Field(1.0, ge=0, description="prefix cache memory (0: off)")
    prefix_cache_dir: str | None = Field(
        None, description="keep prefix-cache entries as files here too, reused after a restart"
    )
    prefix_cache_disk_gb: float = Field(
        10.0, ge=0, description="most disk the prefix cache's files may use (oldest used first out)"
    )
    parallel: Literal["tensor", "pipeline"] | None = Field(
        None, description="split the model across the ranks of an mlx.launch job (rank 0 serves)"
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='drafted decoding, as JSON: {"method": "ngram", "num_speculative_tokens": '
        "K} drafts K tokens a step from the request's own prompt and output (prompt_lookup_min, "
        "prompt_lookup_max: the n-gram lengths matched, default 2 and 5), or "
        '{"method": "draft_model", "model": NAME, "num_speculative_tokens": K} from a smaller '
        "model with the same tokenizer; requests with no grammar, penalties or logprobs draft",
    )

    lora: tuple[str, ...] = Field(
        (),
        description="a LoRA or DoRA adapter as NAME=PATH (an mlx_lm.lora adapter directory: "
        "adapters.safetensors, adapter_config.json), served as the model NAME: requests for "
        "it and for the base model share one batch; repeat it for several",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_pairs(cls, v: Any) -> Any:
        if isinstance(v, dict):  # a models file's table: {name = "path"}
            return tuple(f"{name}={path}" for name, path in v.items())
        return (v,) if isinstance(v, str) else v

    @field_validator("lora")
    @classmethod
    def _lora_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import re

        seen = set()
        for pair in v:
            name, sep, path = pair.partition("=")
            if not sep or not path:
                raise ValueError(f"a LoRA adapter is NAME=PATH, not {pair!r}")
            if not re.match(MODEL_NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not a name a client can send as `model`")
            if name in seen:
                raise ValueError(f"two LoRA adapters are named {name!r}")
            seen.add(name)
        return v

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters to load: name -> path (`lora`)."""
        return dict(pair.partition("=")[::2] for pair in self.lora)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, v: Any) -> Any:
        if v is None or isinstance(v, SpeculativeConfig):
            return v
        return parse_speculative_config(v)

    @field_validator("prefix_cache_dir", mode="before")
    @classmethod
    def _dir_text(cls, v: Any) -> Any:
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @field_validator("max_step_ms")
    @classmethod
    def _tokens_only(cls, v: float | None) -> float | None:
        return v or None  # 0: schedule by tokens only

    @model_validator(mode="after")
    def _one_kv_budget(self) -> EngineConfig:
        if self.max_kv_tokens is not None and self.max_kv_gb is not None:
            raise ValueError("pass max_kv_tokens or max_kv_gb, not both")
        if self.speculative_config is not None and self.parallel is not None:
            raise ValueError("speculative_config is not supported with parallel")
        return self

    @classmethod
    def from_header(cls, recorded: dict[str, Any]) -> EngineConfig:
        """The options a log's header recorded (keys this version does not know are left out:
        the model, the topology, and those of older or newer versions)."""
        known = {k: v for k, v in recorded.items() if k in cls.model_fields}
        if known.get("max_kv_tokens") is not None:
            known.pop("max_kv_gb", None)  # the header holds the budget resolved in tokens
        return cls(**known)

    def open_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `Engine.open`."""
        return self.model_dump()


class EventLogConfig(_Options):
    """Where the event log goes and what it keeps."""

    event_log: str | None = Field(None, description="append-only JSON-lines event log file")
    event_log_rotate_mb: float | None = Field(
        None, gt=0, description="start a new event-log file (run.1.jsonl, ...) past this size"
    )
    log_prompts: bool = Field(
        True, description="store prompt token ids in the event log (false: counts and a hash)"
    )
    log_outputs: bool = Field(
        True, description="store output token ids in the event log (false: only how many)"
    )
    events_in_memory: int = Field(
        DEFAULT_CAPACITY,
        ge=1,
        description="the last events kept in memory for GET /v1/events and /dashboard (older "
        "ones are read back from --event-log)",
    )

    @field_validator("event_log", mode="before")
    @classmethod
    def _path_text(cls, v: Any) -> Any:
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @property
    def rotate_bytes(self) -> int | None:
        mb = self.event_log_rotate_mb
        return None if mb is None else int(mb * 2**20)


class ServerConfig(_Options):
    """How `stepline serve` serves HTTP."""

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free one)")
    api_key: str | None = Field(
        None,
        description="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route "
        "but / and /health (default: $STEPLINE_API_KEY; unset: no key)",
    )
    served_model_name: tuple[str, ...] = Field(
        (),
        description="a name clients may send as `model` (repeatable; the first is what "
        "/v1/models lists; default: the model's own name)",
    )
    allowed_origins: tuple[str, ...] = Field(
        (),
        description="a web origin (https://app.example) allowed to call the server from a "
        "browser (repeatable; default: none, no CORS headers)",
    )
    metrics_public: bool = Field(
        False, description="serve /metrics without the API key (default: behind it)"
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,  # a 128k-token conversation is well under 1 MiB
        ge=1,
        description="largest request body accepted, else 413",
    )
    limit_concurrency: int = Field(
        1024,
        ge=1,
        description="most requests in flight at once (a stream counts until it ends); 503 past "
        "it. /health and /metrics always answer, and idle connections do not count",
    )
    timeout_keep_alive: float = Field(
        5.0, gt=0, description="close an idle keep-alive connection after this many seconds"
    )
    timeout_request_head: float = Field(
        10.0,  # a slow client on a bad link sends a head in < 1 s
        gt=0,
        description="close a connection that has not sent a whole request head this many "
        "seconds after connecting or after its last response",
    )
    timeout_request_body: float = Field(
        60.0,  # 4 MiB at 1 Mbit/s takes 34 s
        gt=0,
        description="answer 408 to a request whose body has not arrived whole this many "
        "seconds after its head",
    )
    heartbeat_s: float = Field(
        15.0,  # under the 30-60 s idle timeouts of common proxies
        gt=0,
        description="send a keep-alive comment on a stream that has been quiet this long",
    )
    log_format: Literal["console", "json"] = Field(
        "console", description="console (readable) or json (one JSON object a line)"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the least severe log lines written"
    )
    stay_up_when_unhealthy: bool = Field(
        False,
        description="keep the process up (answering 503) after the engine fails, instead of "
        "exiting with status 1 so that a supervisor restarts it",
    )
    next_turn_prefill: bool = Field(
        True,
        description="on: when a chat ends, prefill its conversation as the next request will "
        "send it back (the answer as the template renders it in the history), so an agent's "
        "next turn starts from the cache; each is a one-token request of the engine's own in "
        "the event log (`next-<id>`, origin next-turn), run only in what no client's request "
        "wants and cancelled when one needs its seat or KV; off: none",
    )
    strict_max_tokens: bool = Field(
        False,
        description="refuse (400) a max_tokens larger than the room left in the context; by "
        "default it is clamped to that room and the response's x-stepline-max-tokens header "
        "says so (agents such as Claude Code ask for 32000 whatever the model)",
    )
    generation_config: GenerationConfigMode = Field(
        "auto",
        description="auto: each model's generation_config.json (temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_new_tokens) is its default sampling, under a request's "
        "own values; none: the server's built-in defaults (as vLLM's flag of the same name)",
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens an answer gets when its request sets no max_tokens (default: "
        "the model's max_new_tokens, else 4096); a request asks for more itself, up to the "
        "room left in the context",
    )
    loop_guard: Literal["auto", "on", "off"] = Field(
        "auto",
        description="end an answer that repeats itself verbatim (a sentence looped again and "
        "again): finish_reason length (Anthropic: max_tokens), reason loop in the event log. "
        "auto: every request but one with ignore_eos (it asks for exactly its length); on: "
        "every request; off: none",
    )
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "think"] | None = Field(
        None,
        description="split the model's think block into `reasoning_content` (OpenAI) / "
        "thinking blocks (Anthropic); the tags are those mlx-lm finds in the vocabulary "
        "(<think>...</think> for Qwen3 and DeepSeek-R1)",
    )
    chat_template: str | None = Field(
        None, description="a Jinja chat template to use instead of the model's own"
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="template arguments for every request, e.g. '{\"enable_thinking\": false}'; "
        "a request's chat_template_kwargs override them",
    )
    allow_image_urls: bool = Field(
        False,
        description="fetch the http(s) URLs of image parts; off, a request sends its images as "
        "data URLs or base64. On, the server fetches any URL a client names, hosts on its own "
        "network included: turn it on only where every client may reach what the server can",
    )
    image_fetch_timeout_s: float = Field(
        10.0,
        gt=0,
        description="answer 400 for an image URL whose fetch (redirects and body included) "
        "takes longer than this many seconds",
    )
    max_image_bytes: int = Field(
        MAX_IMAGE_BYTES,
        ge=1,
        description="largest image accepted, in bytes as sent (a fetched one's too), else 400; "
        "an image sent in the body also counts toward --max-body-bytes",
    )
    max_image_pixels: int = Field(
        MAX_IMAGE_PIXELS,
        ge=1,
        description="most pixels (width x height) in one image, else 400; read from the "
        "image's header, before its pixels are decoded",
    )
    max_images_per_request: int = Field(
        MAX_IMAGES_PER_REQUEST,
        ge=1,
        description="most images in one request (its whole conversation), else 400",
    )
    max_image_pixels_in_flight: int = Field(
        MAX_PIXELS_IN_FLIGHT,
        ge=1,
        description="most decoded image pixels the whole server holds at once (~3 bytes each, "
        "up to ~15 while the image processor makes the encoder's inputs), counted from before "
        "an image is decoded until those inputs are made; an image waits for room, 429 "
        "images_busy after 30 s. At least --max-image-pixels",
    )
    max_audio_bytes: int = Field(
        MAX_AUDIO_BYTES,
        ge=1,
        description="largest audio clip accepted, in bytes as sent, else 400 audio_too_large; "
        "a clip sent in the body also counts toward --max-body-bytes",
    )
    max_audio_seconds: float = Field(
        MAX_AUDIO_SECONDS,
        gt=0,
        description="longest audio clip accepted, in seconds, else 400 audio_too_long; read "
        "from the file's header, before its samples are decoded",
    )
    max_audio_sample_rate: int = Field(
        MAX_AUDIO_SAMPLE_RATE,
        ge=1,
        description="highest sample rate of an audio clip accepted (Hz, the file's own: clips "
        "are resampled to the model's), else 400 audio_sample_rate_too_high",
    )
    max_audios_per_request: int = Field(
        MAX_AUDIOS_PER_REQUEST,
        ge=1,
        description="most audio clips in one request (its whole conversation), else 400",
    )
    resume_grace_s: float = Field(
        60.0,
        ge=0,
        description="a resumable stream whose client went away runs on this long for a "
        "reconnect (GET /v1/requests/{id}/stream) and stays resumable this long after it ended",
    )
    responses_ttl_s: float = Field(
        3600.0,
        ge=0,
        description="keep a /v1/responses response (for retrieve, streaming it again and "
        "previous_response_id) this long after it ended",
    )

    @model_validator(mode="after")
    def _one_image_fits_the_budget(self) -> ServerConfig:
        if self.max_image_pixels_in_flight < self.max_image_pixels:
            raise ValueError(
                f"max_image_pixels_in_flight ({self.max_image_pixels_in_flight:,}) is below "
                f"max_image_pixels ({self.max_image_pixels:,}): the largest image allowed "
                "could never be decoded; raise it, or lower max_image_pixels"
            )
        return self


MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$"


class ModelSpec(_Options):
    """One model of a server of several: the name clients send as `model` (and its aliases),
    what to load, and its own engine options over the server's."""

    name: str = Field(pattern=MODEL_NAME_PATTERN, description="the name clients send as `model`")
    model: str | None = Field(
        None,
        description="what to load: a GGUF file, an mlx-lm directory, a Hugging Face id "
        "or a built-in name (default: the name itself)",
    )
    aliases: tuple[str, ...] = Field((), description="other names clients may send for it")
    pinned: bool = Field(False, description="never unloaded (for room or for idleness)")
    ttl_s: float | None = Field(
        None, gt=0, description="unload it after this many idle seconds (default: the server's)"
    )
    generation_config: GenerationConfigMode | None = Field(
        None,
        description="read its generation_config.json (auto) or not (none; default: the "
        "server's --generation-config)",
    )
    default_max_tokens: int | None = Field(
        None, ge=1, description="its answers' cap when a request sets none (over the server's)"
    )
    sampling: SamplingDefaults = Field(
        SamplingDefaults(),
        description="its default temperature, top_p, top_k, min_p, repetition_penalty (over "
        "its generation_config.json)",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="its `EngineConfig` fields (max_step_tokens, max_kv_gb, dtype, ...) over "
        "the server's",
    )

    @field_validator("options")
    @classmethod
    def _engine_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(EngineConfig.model_fields))
        if unknown:
            raise ValueError(
                f"unknown option {', '.join(map(repr, unknown))}: a model takes "
                f"{', '.join(k for k in EngineConfig.model_fields if k != 'parallel')}"
            )
        if v.get("parallel") is not None:
            raise ValueError("a server of several models cannot split one across ranks (parallel)")
        EngineConfig(**v)  # each value checked now, not at its first load
        return v

    @property
    def source(self) -> str:
        """What to load (`Engine.open`'s model)."""
        return self.model or self.name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters it serves (its `lora` option's names): models of their own."""
        lora = self.options.get("lora", ())
        return tuple(EngineConfig.model_validate({"lora": lora}).adapters) if lora else ()

    def engine_config(self, server: dict[str, Any]) -> EngineConfig:
        """Its engine options: `server`'s (the command line's), with its own over them."""
        return EngineConfig(**{**server, **self.options})

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """A `--model` value: `NAME=WHAT` (served as NAME), or `WHAT` (served by its own name:
        a file's or directory's without its suffix). Raises ValueError."""
        import re
        from pathlib import Path

        name, sep, what = text.partition("=")
        if sep and name and "/" not in name and not name.startswith((".", "~")):
            return cls.model_validate({"name": name, "model": what})
        if re.match(MODEL_NAME_PATTERN, text) and not Path(text).expanduser().exists():
            return cls.model_validate({"name": text})
        return cls.model_validate({"name": Path(text).stem or text, "model": text})


class PoolConfig(_Options):
    """A server of several models: which, and what decides that a model stays loaded."""

    models: tuple[ModelSpec, ...] = Field(min_length=1)
    max_memory_gb: float | None = Field(
        None,
        gt=0,
        description="memory all loaded models may take together (weights, KV budget, prefix "
        "cache): least recently used idle models are unloaded to make room (default: 70% of "
        "the machine's)",
    )
    model_ttl_s: float | None = Field(
        None, gt=0, description="unload a model after this many idle seconds (default: never)"
    )
    max_model_wait_s: float = Field(
        300.0,
        gt=0,
        description="a request waits at most this long for its model to be loaded (while "
        "busy models hold the memory it needs), then gets a 503",
    )

    @model_validator(mode="after")
    def _names_once(self) -> PoolConfig:
        seen: dict[str, str] = {}
        for spec in self.models:
            for name in (*spec.names, *spec.adapter_names):
                if name in seen:
                    raise ValueError(
                        f"the name {name!r} is given to two models ({seen[name]!r} and "
                        f"{spec.name!r}): each name must be one model's"
                    )
                seen[name] = spec.name
        return self

    def spec_of(self, name: str) -> ModelSpec | None:
        """The model a client's `model` names (by its name, an alias or one of its LoRA
        adapters' names), or None."""
        return next((s for s in self.models if name in (*s.names, *s.adapter_names)), None)


def read_models_file(path: str | os.PathLike) -> tuple[ModelSpec, ...]:
    """The models of a TOML file: a `[models.NAME]` table for each, with `model`, `aliases`,
    `pinned`, `ttl_s`, its defaults (`generation_config`, `default_max_tokens`, and the
    sampling keys `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`) and any
    `EngineConfig` field (`max_step_tokens`, `max_kv_gb`, ...):

        [models.small]
        model = "SmolLM2-135M-Instruct"
        aliases = ["claude-haiku-4-5"]
        pinned = true
        temperature = 0.2

    Raises ValueError naming the file and what is wrong; OSError if it cannot be read."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not TOML ({exc})") from None
    tables = data.get("models")
    extra = sorted(set(data) - {"models"})
    if not isinstance(tables, dict) or not tables or extra:
        raise ValueError(
            f"{path}: expected only [models.NAME] tables (one a model)"
            + (f", not {', '.join(map(repr, extra))}" if extra else "")
        )
    own = {"model", "aliases", "pinned", "ttl_s", "generation_config", "default_max_tokens"}
    specs = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [models.{name}] must be a table")
        fields = {k: v for k, v in table.items() if k in own}
        sampling = {k: v for k, v in table.items() if k in SAMPLING_KEYS}
        options = {k: v for k, v in table.items() if k not in own and k not in SAMPLING_KEYS}
        try:
            specs.append(
                ModelSpec.model_validate(
                    {**fields, "name": name, "sampling": sampling, "options": options}
                )
            )
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in err["loc"] if p not in ("options", "sampling"))
            what = err["msg"].removeprefix("Value error, ")
            where = f"{where}: " if where else ""
            raise ValueError(f"{path}: [models.{name}]: {where}{what}") from None
    return tuple(specs)


def launch_rank() -> int:
    """This process's rank, as `mlx.launch` or `mpirun` set it (0 when not launched)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0
