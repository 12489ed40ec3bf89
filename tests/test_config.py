"""One typed set of engine options: what `Engine.open` takes, the CLI builds and the event
log records, so re-execution opens an engine configured the same way."""

from __future__ import annotations

import argparse

import pytest

from stepline.api.cli import _add_engine_args, _engine_kwargs
from stepline.api.config import EngineConfig
from stepline.api.engine import Engine
from stepline.events.log import read_header


def test_two_kv_budgets_and_out_of_range_values_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(max_kv_tokens=100, max_kv_gb=1.0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        EngineConfig(max_step_tokens=0)
    with pytest.raises(ValueError, match="parallel"):
        EngineConfig(parallel="data")


def test_cli_flags_become_the_same_options_as_the_python_api() -> None:
    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    args = parser.parse_args(
        ["--max-step-tokens", "256", "--max-waiting", "7", "--max-step-ms", "0"]
    )
    kwargs = _engine_kwargs(args)
    options = EngineConfig(**{k: v for k, v in kwargs.items() if k in EngineConfig.model_fields})
    assert options == EngineConfig(max_step_tokens=256, max_waiting=7, max_step_ms=None)
    assert set(kwargs) - set(EngineConfig.model_fields) == {
        "event_log",
        "event_log_rotate_bytes",
        "log_prompts",
        "log_outputs",
    }


async def test_the_log_header_records_options_that_reopen_the_same_engine(
    tmp_path, model_cache_dir
) -> None:
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=4, max_kv_gb=0.001, seed=5, event_log=log
    ) as engine:
        resolved = engine.step_loop.config.max_kv_tokens
    recorded = EngineConfig.from_header(read_header(log).config)
    assert recorded == EngineConfig(
        max_step_tokens=64, max_num_seqs=4, max_kv_tokens=resolved, seed=5
    )
    async with Engine.open("stepline-demo", **recorded.open_kwargs()) as again:
        assert again.step_loop.config.max_kv_tokens == resolved
