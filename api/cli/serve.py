"""`stepline serve`'s flags: `--model`, the engine's (`EngineConfig`, `EventLogConfig`) and the
server's (`ServerConfig`), each made from its field (api/cli/flags.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from stepline.api.cli.flags import FILE, JSON_OBJECT, add_flags, options
from stepline.api.config import ServerConfig


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `stepline serve` to the CLI's subparsers."""
    from stepline.api.cli import add_engine_args

    p = subparsers.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI, Responses, Anthropic and Ollama APIs)",
        description="Serve a model over HTTP: the OpenAI API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /v1/responses), Anthropic's (/v1/messages), Ollama's "
        "(/api/chat, /api/generate, /api/tags, ...), /health, /metrics.",
    )
    add_engine_args(p)
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
    from stepline.api.cli import engine_kwargs
    from stepline.api.http.serve import run_serve

    return run_serve(args.model, engine_kwargs(args), ServerConfig(**options(args, ServerConfig)))
