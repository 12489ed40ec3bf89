"""The `stepline serve` process: the listening socket, the loading app until the engine is
ready, and uvicorn run in this process (`run_serve`), or in a test's event loop
(`serve_in_process`). Its flags are made in api/cli/serve.py."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from stepline.api.config import EngineConfig, EventLogConfig, PoolConfig, ServerConfig
from stepline.api.engine import launch_rank, run
from stepline.api.http.doors import DOORS
from stepline.api.http.guard import (
    RateLimitedExceptionHandler,
    RefuseAmbiguousLength,
    RequestLimit,
    guarded_protocol,
    raise_open_file_limit,
)
from stepline.api.http.loading import loading_app
from stepline.api.http.log_config import configure_logging
from stepline.api.responses.recovery import interrupted_responses

if TYPE_CHECKING:
    from stepline.api.pipeline.served import Models

log = structlog.get_logger(__name__)

PROBE_PATHS = frozenset({"/health", "/metrics"})
# ServerConfig's fields uvicorn's process uses (`server_config`); the rest are the app's.
PROCESS_OPTIONS = frozenset({"limit_concurrency", "timeout_keep_alive", "timeout_request_head"})
UNHEALTHY_EXIT_DELAY_S = 1.0  # streams get their error frames, probes see 503, then exit
# At a stop, how long the engine's close waits for MLX work still running (a step usually
# ends within it; the model's load, or a warm-up step on a busy CPU, may take a minute and
# cannot be interrupted): the process then ends without it (`end_process`).
MLX_WAIT_AT_EXIT_S = 1.0


class EngineFailed(RuntimeError):
    """The engine failed while serving: `stepline serve` exits with status 1."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Binding before the
    model loads turns "port in use" into an immediate, clear error (uvicorn would call
    sys.exit) and lets early clients queue instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)  # TCP_NODELAY: `http_guard.set_nodelay`
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
        # Called first when the server stops (the engine's `begin_shutdown`): open streams
        # end at once with a last frame, rather than after the grace period, cut off.
        self.on_shutdown: Callable[[], object] | None = None

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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets)


def base_url(host: str, port: int) -> str:
    """The URL a local client dials for a server listening on (host, port), no path."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # what a local client dials
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def server_config(
    app: Any,
    cfg: ServerConfig,
    *,
    log_level: str = "warning",
    access_log: bool = False,
    graceful_shutdown_s: float = 5.0,
) -> uvicorn.Config:
    """uvicorn's config for `app` under `cfg`: logging left to `log_config`
    (log_config=None), at most `cfg.limit_concurrency` requests in flight (503 past it;
    /health and /metrics always answer, and idle connections do not count), idle keep-alive
    connections closed after `cfg.timeout_keep_alive`, and a connection that has not sent a
    whole request head `cfg.timeout_request_head` after connecting (or after its last
    response) closed. A request with both Transfer-Encoding and Content-Length is refused
    (400) and its connection closed, and so is a chunk of a chunked body that says it holds
    more than `cfg.max_body_bytes` (413; 400 for a size past any body's)."""
    app = RequestLimit(app, limit=cfg.limit_concurrency, open_paths=PROBE_PATHS)
    app = RefuseAmbiguousLength(app)
    return uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=graceful_shutdown_s,  # type: ignore[arg-type]
        limit_concurrency=None,  # uvicorn's counts idle connections: RequestLimit instead
        timeout_keep_alive=cfg.timeout_keep_alive,  # type: ignore[arg-type]
        http=guarded_protocol(cfg.timeout_request_head, cfg.max_body_bytes),
    )


@asynccontextmanager
async def serve_in_process(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    graceful_shutdown_s: float = 2.0,
    **options: Any,
) -> AsyncIterator[str]:
    """Run `app` under uvicorn in this event loop and yield its base URL (no `/v1`); stops
    the server on exit (open streams get `graceful_shutdown_s`, then are cancelled). For tests
    and benchmarks; `options` are `ServerConfig`'s fields for the process (`PROCESS_OPTIONS`:
    the app's own, such as `timeout_request_body`, go to `create_app`). Raises TypeError for
    any other."""
    if stray := options.keys() - PROCESS_OPTIONS:
        raise TypeError(f"serve_in_process takes the process's options only, not {sorted(stray)}")
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    cfg = ServerConfig(host=host, port=bound_port, **options)
    server = _Server(
        server_config(app, cfg, graceful_shutdown_s=graceful_shutdown_s), own_signals=False
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        try:
            with anyio.fail_after(30):
                await server.ready.wait()
            yield base_url(host, bound_port)
        finally:
            server.should_exit = True


def _curl_line(url: str, model: str, api_key: str | None, embedding: Any = None) -> str:
    """A request to try: a streamed chat, or for an embedding model (`embedding`: its
    `EmbedParams`) an embedding, for a reranker a rerank."""
    auth = ' -H "Authorization: Bearer $STEPLINE_API_KEY"' if api_key else ""
    route, body = (
        "chat/completions",
        (
            f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
            '"max_tokens": 64, "stream": true}'
        ),
    )
    if embedding is not None and embedding.head_tokens:
        route = "rerank"
        body = f'{{"model": "{model}", "query": "Hello?", "documents": ["Hello!", "Bye."]}}'
    elif embedding is not None:
        route, body = "embeddings", f'{{"model": "{model}", "input": "Hello!"}}'
    return f"curl -N {url}/v1/{route} -H 'Content-Type: application/json'{auth} -d '{body}'"


class _AppSwitch:
    """The ASGI app uvicorn serves: `loading_app` until the engine is ready, then the real one.
    uvicorn starts before the model loads, so /health answers (503 loading) from the start."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _describe_model(model: str | None) -> str:
    if model is None or model == "SmolLM2-135M-Instruct":
        return (
            "SmolLM2-135M-Instruct, the default model (135M parameters: expect simple answers; "
            "--model serves a bigger one)"
        )
    local = Path(model).expanduser()
    if local.is_dir():
        return f"{model} from the local directory {local.resolve()}"
    if local.is_file():
        return f"{model} (a GGUF file: converted once into the cache)"
    return f"{model} (a demo name, else a Hugging Face id: from the Hugging Face cache or hub)"


def _import_engine_modules() -> None:
    for name in ("stepline.engine.models", "stepline.engine.runner", "stepline.events.log"):
        importlib.import_module(name)


class _BackgroundImport:
    """Imports modules on a thread of its own, from now on; `module()` waits for them (and
    raises what an import raised) and returns the first."""

    def __init__(self, *names: str):
        self._names = names
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"import-{names[0]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for name in self._names:
                importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - raised again where it is awaited
            self._error = exc

    async def module(self) -> Any:
        # Cancelled (a stop while loading): the import goes on, and the process ends anyway.
        await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)
        if self._error is not None:
            raise self._error
        return importlib.import_module(self._names[0])


async def _serve(
    model: str | PoolConfig | None, engine_kwargs: dict, cfg: ServerConfig, sock: socket.socket
) -> None:
    """Serve `model` (or a pool's models) on `sock` until a stop; raises EngineFailed when a
    single model's engine fails."""
    asyncio.get_running_loop().set_exception_handler(RateLimitedExceptionHandler())
    if isinstance(model, PoolConfig):
        loading_name: str | None = ", ".join(s.name for s in model.models)
    else:
        loading_name = model
    switch = _AppSwitch(loading_app(loading_name or "SmolLM2-135M-Instruct"))
    config = server_config(switch, cfg, log_level=cfg.log_level, access_log=True)
    server = _Server(config, own_signals=True)
    url = base_url(cfg.host, sock.getsockname()[1])
    if isinstance(model, PoolConfig):
        print(f"stepline: serving {loading_name}: each loads on its first request", flush=True)
    else:
        print(f"stepline: loading {_describe_model(model)}", flush=True)
        print(f"stepline: {url}/health answers 503 (loading) until the model is ready", flush=True)

    async def run_server(*, cancel: anyio.CancelScope) -> None:
        await server.serve(sockets=[sock])
        cancel.cancel()  # the server stopped (SIGINT, SIGTERM): close the engine too

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(run_server, cancel=tg.cancel_scope))
            await server.ready.wait()
            # MLX, mlx-lm and transformers take seconds to import: not on the event loop,
            # which answers /health meanwhile (and a stop meanwhile does not wait for them).
            await anyio.to_thread.run_sync(_import_engine_modules, abandon_on_cancel=True)
            # After that import: mlx_lm.utils sets the limit to (2048, 4096) when imported.
            soft, hard = raise_open_file_limit()
            log.info("open_file_limit", soft=soft, hard=hard)
            # The HTTP app's modules import on a thread of their own while the engine loads
            # and warms up, mostly outside the GIL: the doors' handlers too, which import the
            # SDKs whose types they build (2-10 s; imported by `create_app`, on the event
            # loop, they held /health's answers that long).
            app_modules = _BackgroundImport(
                "stepline.api.http.app", *(f"stepline.api.{door}.serving" for door in DOORS)
            )
            interrupted: list[tuple[str, float]] = []
            event_log = engine_kwargs.get("event_log")
            if event_log is not None:  # background responses a crash cut off
                since = time.time() - cfg.responses_ttl_s
                interrupted = await anyio.to_thread.run_sync(
                    functools.partial(interrupted_responses, event_log, since=since),
                    abandon_on_cancel=True,  # a long log's read: a stop does not wait
                )
            up = _Up(cfg, server, switch, app_modules, url, interrupted)
            if isinstance(model, PoolConfig):
                await _serve_pool(model, engine_kwargs, up)
            else:
                await _serve_engine(model, engine_kwargs, up)
    except BaseExceptionGroup as group:  # one failure (a model not found): raise it alone
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


@dataclasses.dataclass(frozen=True)
class _Up:
    """The server as it is up, before its app: what serving one model or several goes on from."""

    cfg: ServerConfig
    server: _Server
    switch: _AppSwitch  # answers with the loading app until the real one is set
    app_modules: _BackgroundImport  # the app's modules, importing on a thread
    url: str
    interrupted: list[tuple[str, float]]  # background responses a crash cut off

    async def start_app(self, models: Models[Any]) -> None:
        """Serve `models` (a pool, or `OneModel`: a pool of one) with the real app from now
        on; a stop begins with their `begin_shutdown`, and ends the readers of their events."""
        create_app = (await self.app_modules.module()).create_app

        def begin_shutdown() -> int:
            if (feed := models.feed) is not None:
                feed.close()  # its readers end, rather than hold the server's stop
            return models.begin_shutdown()

        self.server.on_shutdown = begin_shutdown
        options = self.cfg.model_dump()
        self.switch.app = create_app(models, interrupted_responses=self.interrupted, **options)


async def _serve_engine(model: str | None, engine_kwargs: dict, up: _Up) -> None:
    from stepline.api.engine import Engine
    from stepline.api.pipeline.served import OneModel

    cfg, url = up.cfg, up.url

    t0 = time.monotonic()
    opened = Engine.open(model, mlx_wait_at_close_s=MLX_WAIT_AT_EXIT_S, **engine_kwargs)
    async with opened as engine:
        names = cfg.served_model_name or (engine.model_name,)
        await up.start_app(OneModel(engine))
        print(
            f"stepline: loaded {engine.model_name} from {engine.loaded.path} in "
            f"{time.monotonic() - t0:.1f} s; weights {engine.loaded.weights}",
            flush=True,
        )
        served_as = f" (as {', '.join(names)})" if cfg.served_model_name else ""
        print(f"stepline: serving {engine.model_name}{served_as} at {url}/v1 (OpenAI-compatible)")
        _print_try(url, names[0], cfg, engine.embedding)
        if (problem := engine.event_log_problem) is not None:  # a full disk at start
            print(f"stepline: warning: {problem}", file=sys.stderr, flush=True)
        reason = await engine.wait_unhealthy()
        if cfg.stay_up_when_unhealthy:
            await anyio.sleep_forever()
        # Every request has ended with an error; /health says 503 meanwhile. Exit
        # non-zero after a moment, so a supervisor restarts a healthy server.
        log.error("engine_unhealthy_exiting", reason=reason)
        print(f"stepline: error: the engine failed ({reason}); exiting", file=sys.stderr)
        await anyio.sleep(UNHEALTHY_EXIT_DELAY_S)
        raise EngineFailed(reason)


async def _serve_pool(pool_config: PoolConfig, engine_kwargs: dict, up: _Up) -> None:
    """Serve several models until a stop: a model's failure is that model's (its requests
    get errors, /health says so), so only a stop ends it."""
    from stepline.api.pool import ModelPool

    options = {k: v for k, v in engine_kwargs.items() if k in EngineConfig.model_fields}
    events = EventLogConfig(**{k: v for k, v in engine_kwargs.items() if k not in options})
    opened = ModelPool.open(
        pool_config,
        options,
        events,
        mlx_wait_at_close_s=MLX_WAIT_AT_EXIT_S,
    )
    async with opened as pool:
        await up.start_app(pool)
        print(
            f"stepline: serving {', '.join(pool.names)} at {up.url}/v1 (OpenAI-compatible); "
            f"memory budget {pool.budget_bytes / 2**30:.1f} GB",
            flush=True,
        )
        _print_try(up.url, pool.names[0], up.cfg)
        await anyio.sleep_forever()


def _print_try(url: str, name: str, cfg: ServerConfig, embedding: Any = None) -> None:
    if cfg.api_key and os.environ.get("STEPLINE_API_KEY") != cfg.api_key:
        print("stepline: set STEPLINE_API_KEY to the key for the curl line below")
    print(f"try:\n  {_curl_line(url, name, cfg.api_key, embedding)}", flush=True)


async def _serve_other_rank(model: str | None, engine_kwargs: dict) -> None:
    from stepline.api.engine import Engine

    async with Engine.open(model, **engine_kwargs):  # ends the process when rank 0 stops
        raise AssertionError("only rank 0 runs an engine's block")


def run_serve(model: str | PoolConfig | None, engine_kwargs: dict, cfg: ServerConfig) -> int:
    """`stepline serve`: listen, load the model (or serve a pool's models, each loaded on
    its first request), serve until Ctrl-C or SIGTERM, then end the process with status 0 (1
    if a single model's engine failed; see `end_process`). Returns 1 if it cannot listen;
    raises what stops it from loading."""
    if isinstance(model, PoolConfig) and engine_kwargs.get("parallel"):
        raise ValueError("--parallel serves one model: give one --model")
    if engine_kwargs.get("event_log") is not None:  # before listening, and loading anything
        from stepline.events.log import check_log_path

        check_log_path(engine_kwargs["event_log"])
    if engine_kwargs.get("parallel") and launch_rank() > 0:  # no HTTP: it mirrors rank 0
        assert not isinstance(model, PoolConfig)
        anyio.run(_serve_other_rank, model, engine_kwargs)
    try:
        sock = bind_socket(cfg.host, cfg.port)
    except OSError as exc:
        print(
            f"stepline: error: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc} "
            "(choose another --port, or stop what is using it)",
            file=sys.stderr,
        )
        return 1
    configure_logging(cfg.log_format, cfg.log_level)
    status = 0
    try:
        run(_serve, model, engine_kwargs, cfg, sock)  # on uvloop (and httptools, if installed)
    except EngineFailed:
        status = 1
    finally:
        sock.close()
    end_process(status)


def end_process(status: int) -> NoReturn:
    """Exit with `status` now that the engine is closed and its log written, without the
    interpreter's teardown: MLX work that the close did not wait for (`MLX_WAIT_AT_EXIT_S`)
    ends with the process. In that teardown a daemon thread that wakes in native code (the
    MLX thread, a tokenizer's worker, MLX's ring backend) is ended with a forced unwind that
    C++ turns into std::terminate: "terminate called without an active exception", exit
    134, which a supervisor counts as a crash. The atexit handlers still run."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
