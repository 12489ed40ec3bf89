"""How to sample one request, as the Python API takes it: bounded where it enters."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stepline.api.json_limits import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    InputLimitError,
    check_text,
)
from stepline.engine.sampling_limits import MAX_INT32, MAX_REPETITION_PENALTY, PENALTY_RANGE
from stepline.events.models import RequestParams


class SamplingParams(BaseModel):
    """How to sample one request. Invalid values raise pydantic's ValidationError (a ValueError)
    whose message names the field and the allowed range; NaN and infinities are refused
    everywhere. A temperature below 1e-5 samples greedily (argmax), like 0. `top_k` and
    `stop_token_ids` are also checked against the model's vocabulary by `Engine.submit`."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(256, ge=1, description="most tokens to generate (>= 1)")
    temperature: float = Field(1.0, ge=0.0, description="0 (or below 1e-5) = greedy; >= 0")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass in (0, 1]")
    top_k: int = Field(
        0, ge=-1, le=MAX_INT32, description="0 or -1 = off; at most the vocabulary size"
    )
    min_p: float = Field(0.0, ge=0.0, lt=1.0, description="0 = off")
    seed: int | None = Field(None, description="same seed + same prompt = same tokens")
    stop: tuple[str, ...] = Field(
        (),
        max_length=MAX_STOP_STRINGS,
        description=f"stop strings, never emitted; none empty; at most {MAX_STOP_STRINGS}",
    )
    stop_token_ids: tuple[int, ...] = Field((), description="token ids in the vocabulary")
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description="1 = off; > 1 penalises"
    )
    repeat_last_n: int | None = Field(
        None,
        ge=-1,
        le=MAX_INT32,
        description="the penalties look at the context's last n tokens (prompt and answer: "
        "Ollama's and llama.cpp's repeat_last_n); 0 = none (no penalty), None or -1 = all",
    )
    loop_guard: bool = Field(
        False,
        description="end the answer (finish_reason 'loop') once it repeats itself verbatim "
        "(stepline.actors.scheduler.loop_guard)",
    )
    logprobs: int | None = Field(None, ge=0, le=20, description="top-k logprobs per token")
    grammar: str | None = Field(None, description="llguidance grammar (stepline.engine.grammar)")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return 0 if v == -1 else v  # both mean off; one spelling in the log

    @field_validator("repeat_last_n")
    @classmethod
    def _repeat_last_n(cls, v: int | None) -> int | None:
        return None if v == -1 else v  # both mean the whole context; one spelling in the log

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty (an empty one would match at once)")
        for i, s in enumerate(v):
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop[{i}] has {len(s)} characters: at most {MAX_STOP_CHARS} per stop string"
                )
            _valid_text(s, f"stop[{i}]")
        return v

    @field_validator("grammar")
    @classmethod
    def _grammar_text(cls, v: str | None) -> str | None:
        if v is not None:
            _valid_text(v, "grammar")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [t for t in v if not 0 <= t <= MAX_INT32]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad[0]}")
        return v

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise InputLimitError (a ValueError naming the field, `param`) if `top_k` or a stop
        token id lies outside a `vocab_size` vocabulary: the one check, for every door."""
        if self.top_k > vocab_size:
            raise InputLimitError(
                f"top_k must be at most the model's vocabulary size ({vocab_size}), or 0 / -1 "
                f"for off; got {self.top_k}",
                param="top_k",
            )
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InputLimitError(
                f"stop_token_ids must be in the model's vocabulary (0..{vocab_size - 1}), "
                f"got {bad[0]}",
                param="stop_token_ids",
            )

    def to_record(self) -> RequestParams:
        return RequestParams(**self.model_dump())


def _valid_text(text: str, param: str) -> None:
    # Recorded in the event log (UTF-8 JSON): a lone surrogate would degrade it for the run.
    try:
        check_text(text, param)
    except InputLimitError as exc:
        raise ValueError(exc.message) from None
