"""`stepline serve`'s flags: `--model`, the engine's (`EngineConfig`, `EventLogConfig`) and the
server's (`ServerConfig`), each made from its field (api/cli/flags.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from stepline.api.cli.flags import FILE, JSON_OBJECT, add_flags, options
from stepline.api.config import ModelSpec, PoolConfig, ServerConfig, read_models_file


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `stepline serve` to the CLI's subparsers."""
    from stepline.api.cli.flags import add_engine_args

    p = subparsers.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI, Responses, Anthropic and Ollama APIs)",
        description="Serve a model over HTTP: the OpenAI API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /v1/responses), Anthropic's (/v1/messages), Ollama's "
        "(/api/chat, /api/generate, /api/tags, ...), /health, /metrics.",
    )
    add_engine_args(p, several=True)
    p.add_argument(
        "--models",
        metavar="FILE",
        default=None,
        help="a TOML file of models to serve, a [models.NAME] table each (model, aliases, "
        "pinned, ttl_s and any engine option); see docs/models.md",
    )
    add_flags(p, PoolConfig, skip=("models",))
    add_flags(
        p,
        ServerConfig,
        special={
            "api_key": {"default": os.environ.get("STEPLINE_API_KEY") or None},
            "chat_template": FILE,
            "default_chat_template_kwargs": JSON_OBJECT,
            "served_model_name": {"metavar": "NAME"},
            "allowed_origins": {"metavar": "ORIGIN"},
        },
        skip=("heartbeat_s",),
    )
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from stepline.api.cli.flags import engine_kwargs
    from stepline.api.http.serve import run_serve

    server = ServerConfig(**options(args, ServerConfig))
    return run_serve(what_to_serve(args), engine_kwargs(args), server)


def what_to_serve(args: argparse.Namespace) -> str | PoolConfig | None:
    """One model (its name, None: the default one), or several: more than one `--model`, a
    `--model NAME=MODEL`, `--models FILE`, or a pool's own option (`--max-memory-gb`,
    `--model-ttl-s`, `--max-model-wait-s`). Raises ValueError for a bad one."""
    given = args.model or []
    # `--models FILE` is read below; a pool option left at its default says nothing
    pool_options = {
        k: v
        for k, v in options(args, PoolConfig).items()
        if k != "models" and v is not None and v != PoolConfig.model_fields[k].default
    }
    several = len(given) > 1 or args.models is not None or bool(pool_options)
    if not several and not any("=" in m for m in given):
        return given[0] if given else None
    specs = [ModelSpec.parse(m) for m in given]
    if args.models is not None:
        specs.extend(read_models_file(args.models))
    if not specs:
        specs = [ModelSpec.parse("SmolLM2-135M-Instruct")]
    if args.served_model_name:
        raise ValueError(
            "--served-model-name names a single model: with several, name each with "
            "--model NAME=MODEL or aliases in --models"
        )
    return PoolConfig(models=tuple(specs), **pool_options)
