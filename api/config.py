"""The engine's options, in one typed model: `Engine.open`, the CLI and re-execution share it.

`Engine.open(...)` takes these as keyword arguments and validates them here; the CLI builds
one from its flags; the event log's header records one (plus what the engine resolved, such
as the measured KV budget in tokens), and `stepline replay --reexecute` reads it back to
open an engine configured the same way. No MLX here.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stepline.engine.policy import DEFAULT_MAX_STEP_MS


class EngineConfig(BaseModel):
    """How an engine schedules, remembers and budgets (see `Engine.open` for each field)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_step_tokens: int = Field(512, ge=1)
    max_num_seqs: int = Field(32, ge=1)
    long_prefill_cap: int | None = Field(None, ge=1)
    max_step_ms: float | None = Field(DEFAULT_MAX_STEP_MS, gt=0)
    max_kv_tokens: int | None = Field(None, ge=1)
    max_kv_gb: float | None = Field(None, gt=0)
    max_waiting: int = Field(1024, ge=1)
    mlx_cache_gb: float | None = Field(None, ge=0)
    grammar_cache_mb: float = Field(256.0, ge=0)
    seed: int = 0
    prefix_cache_gb: float = Field(1.0, ge=0)
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float = Field(10.0, ge=0)
    parallel: Literal["tensor", "pipeline"] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16", "keep"] = "auto"

    @model_validator(mode="after")
    def _one_kv_budget(self) -> EngineConfig:
        if self.max_kv_tokens is not None and self.max_kv_gb is not None:
            raise ValueError("pass max_kv_tokens or max_kv_gb, not both")
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


def launch_rank() -> int:
    """This process's rank, as `mlx.launch` or `mpirun` set it (0 when not launched)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0
