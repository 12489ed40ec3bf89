"""One typed set of engine options: what `Engine.open` takes, the CLI builds and the event
log records, so re-execution opens an engine configured the same way."""

from __future__ import annotations

import argparse

import pytest

from stepline.api.cli import add_engine_args, engine_kwargs
from stepline.api.cli.serve import add_serve_parser
from stepline.api.config import EngineConfig, EventLogConfig, ServerConfig
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
    add_engine_args(parser)
    args = parser.parse_args(
        ["--max-step-tokens", "256", "--max-waiting", "7", "--max-step-ms", "0"]
        + ["--log-prompts", "false", "--event-log-rotate-mb", "2"]
    )
    kwargs = engine_kwargs(args)
    options = EngineConfig(**{k: v for k, v in kwargs.items() if k in EngineConfig.model_fields})
    assert options == EngineConfig(max_step_tokens=256, max_waiting=7, max_step_ms=None)
    log = EventLogConfig(**{k: v for k, v in kwargs.items() if k in EventLogConfig.model_fields})
    assert log == EventLogConfig(log_prompts=False, event_log_rotate_mb=2)
    assert log.rotate_bytes == 2 * 2**20


def test_every_flag_defaults_to_its_options_default() -> None:
    """A flag left out gives what `Engine.open` and `create_app` would use on their own."""
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_serve_parser(sub).parse_args([])
    for model in (EngineConfig, EventLogConfig, ServerConfig):
        for name, field in model.model_fields.items():
            if hasattr(args, name) and name != "api_key":  # its default is $STEPLINE_API_KEY
                given = getattr(args, name)
                assert given == field.default or (given is None and field.default == ()), name


def test_server_flags_read_files_json_and_repeated_names(tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_serve_parser(sub).parse_args(
        ["--chat-template", str(template), "--default-chat-template-kwargs", '{"a": 1}']
        + ["--served-model-name", "x", "--served-model-name", "y", "--strict-max-tokens"]
        + ["--reasoning-parser", "qwen3"]
    )
    from stepline.api.cli.flags import options

    config = ServerConfig(**options(args, ServerConfig))
    assert config.chat_template == "{{ messages[0]['content'] }}"
    assert config.default_chat_template_kwargs == {"a": 1}
    assert config.served_model_name == ("x", "y")
    assert config.strict_max_tokens and config.reasoning_parser == "qwen3"


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
