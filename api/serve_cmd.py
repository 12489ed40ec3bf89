"""`stepline serve`: the command's flags, the listening socket, and uvicorn run in this
process (`run_serve`), or in a test's event loop (`serve_in_process`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI

from stepline.api.server import DEFAULT_MAX_BODY_BYTES, create_app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Binding before the
    model loads turns "port in use" into an immediate, clear error (uvicorn would call
    sys.exit) and lets early clients queue instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn that tells when it accepts connections. With `own_signals`, SIGINT and SIGTERM
    start a graceful shutdown (a second SIGINT forces it) and are not re-raised afterwards, as
    uvicorn would: a re-raised SIGTERM kills the process before the engine closes and flushes
    its event log. Without, signals stay the host's (tests)."""

    def __init__(self, config: uvicorn.Config, *, own_signals: bool):
        super().__init__(config)
        self.own_signals = own_signals
        self.ready = anyio.Event()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.own_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def _url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # what a local client dials
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@asynccontextmanager
async def serve_in_process(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, graceful_shutdown_s: float = 2.0
) -> AsyncIterator[str]:
    """Run `app` under uvicorn in this event loop and yield its base URL (no `/v1`); stops
    the server on exit (open streams get `graceful_shutdown_s`, then are cancelled). For tests
    and benchmarks."""
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    server = _Server(config, own_signals=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        try:
            with anyio.fail_after(30):
                await server.ready.wait()
            yield _url(host, bound_port)
        finally:
            server.should_exit = True


def _curl_line(url: str, model: str, api_key: str | None) -> str:
    auth = ' -H "Authorization: Bearer $STEPLINE_API_KEY"' if api_key else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 64, "stream": true}'
    )
    return (
        f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


async def _serve(args: argparse.Namespace, sock: socket.socket, engine_kwargs: dict) -> None:
    from stepline.api.engine import Engine

    async with Engine.open(args.model, **engine_kwargs) as engine:
        app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
        config = uvicorn.Config(app, lifespan="off", log_level="info", timeout_graceful_shutdown=5)
        server = _Server(config, own_signals=True)
        url = _url(args.host, sock.getsockname()[1])
        print(f"stepline: serving {engine.model_name} at {url}/v1 (OpenAI-compatible)")
        if args.api_key and os.environ.get("STEPLINE_API_KEY") != args.api_key:
            print("stepline: set STEPLINE_API_KEY to the key for the curl line below")
        print(f"try:\n  {_curl_line(url, engine.model_name, args.api_key)}", flush=True)
        await server.serve(sockets=[sock])


def run_serve(args: argparse.Namespace) -> int:
    """`stepline serve`: load the model, serve it until Ctrl-C. Returns the exit status."""
    engine_kwargs = args.engine_kwargs(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"stepline: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} "
            "(choose another --port, or stop what is using it)",
            file=sys.stderr,
        )
        return 1
    # uvloop (and httptools, which uvicorn picks by itself) cut the HTTP layer's CPU per
    # token when installed (`uvicorn[standard]`); plain asyncio and h11 work the same.
    use_uvloop = importlib.util.find_spec("uvloop") is not None
    try:
        anyio.run(_serve, args, sock, engine_kwargs, backend_options={"use_uvloop": use_uvloop})
    finally:
        sock.close()
    return 0


def add_serve_parser(
    subparsers: Any,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    engine_kwargs: Callable[[argparse.Namespace], dict],
) -> argparse.ArgumentParser:
    """Add `stepline serve` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics).",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("STEPLINE_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $STEPLINE_API_KEY; "
        "unset = no key)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, else 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )
    p.set_defaults(func=run_serve, engine_kwargs=engine_kwargs)
    return p
