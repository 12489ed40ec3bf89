"""Helpers shared by test modules (on pytest's `pythonpath`: `from helpers import ...`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import pytest

from stepline.actors import step_loop
from stepline.actors.scheduler.cost_model import StepCost

if TYPE_CHECKING:
    from stepline.actors.step_loop import StepLoop
    from stepline.api import Engine
    from stepline.api.stream import RequestStream
    from stepline.events.fold import RequestState

T = TypeVar("T")

# A fixed step-time model for scheduling tests, roughly stepline-demo-large on a CPU: 20 ms
# a step, 0.4 ms a prompt token, attention noticeable past a few thousand tokens of context.
DEMO_LARGE_COST = StepCost(
    step=0.004,
    per_chunk=0.002,
    per_prefill_token=0.0004,
    per_attention=4e-8,
    per_decode_row=0.002,
    per_decode_context=1e-6,
)


async def hold_open(cm: AbstractAsyncContextManager[T]) -> tuple[T, Callable[[], Awaitable[None]]]:
    """Enter `cm` in a task of its own and return (its value, a function that exits it).

    pytest-asyncio sets a fixture up and tears it down in different tasks, and anyio task
    groups (the engine's, uvicorn's) must be exited by the task that entered them.
    """
    ready: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    async def hold() -> None:
        try:
            async with cm as value:
                ready.set_result(value)
                await stop.wait()
        except Exception as exc:
            if ready.done():
                raise
            ready.set_exception(exc)

    task = asyncio.create_task(hold())
    try:
        value = await ready
    except BaseException:
        await task
        raise

    async def close() -> None:
        stop.set()
        await task

    return value, close


async def collect(stream: AsyncIterator[T]) -> list[T]:
    """Every item of `stream` (a request's outputs), in order, once it has ended."""
    return [item async for item in stream]


def mlx_lm_greedy(model: Any, prompt: list[int], n: int, stop: Collection[int] = ()) -> list[int]:
    """mlx-lm's own single-request greedy generation of up to `n` tokens after `prompt`, cut
    before the first token in `stop`: the reference the engine's tokens are checked against."""
    import mlx.core as mx  # here: the model-free tests import this module without MLX
    from mlx_lm.generate import generate_step

    from stepline.engine import experts, gated_delta

    tokens = []
    # mlx-lm's own recurrence and experts, not the engine's (`gated_delta`, `experts`)
    with gated_delta.mlx_lm_own(), experts.mlx_lm_own():
        steps = generate_step(
            mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
        )
        for token, _ in steps:
            if int(token) in stop:
                break
            tokens.append(int(token))
    return tokens


async def wait_until(loop: StepLoop, predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Return once `predicate()` holds; TimeoutError after `within` seconds. The step loop
    `loop` checks it again after each of its turns (`StepLoop.wait_until`): it may read the
    loop's state, or the executor's (which changes only inside a step or housekeeping call)."""
    with anyio.fail_after(within):
        await loop.wait_until(predicate)


async def submit_together(
    engine: Engine, requests: Sequence[dict[str, Any]]
) -> list[RequestStream]:
    """Submit `requests` (each `Engine.submit`'s arguments) at once to an engine that is
    idle, and return their streams, in order. An idle engine waits for the requests on their
    way before its first step (at most `GATHER_S`: here, however long it takes), so all of
    them are admitted before any runs; sent one after another on a busy machine, the first
    had run for steps before the last came."""
    loop = engine.step_loop
    await wait_until(loop, lambda: loop.settled, within=60)
    streams: list[RequestStream | None] = [None] * len(requests)

    async def submit(i: int) -> None:
        streams[i] = await engine.submit(**requests[i])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_loop, "GATHER_S", 60.0)
        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(submit, i)
    return [stream for stream in streams if stream is not None]


async def wait_finished(loop: StepLoop, request_id: str, within: float = 10.0) -> RequestState:
    """The state of `request_id` once the step loop `loop` has ended it (a cancel reaches the
    loop after the client's stream has ended); TimeoutError after `within` seconds."""

    def finished() -> bool:
        state = loop.state_of(request_id)
        return state is not None and state.is_finished

    await wait_until(loop, finished, within)
    return loop.state_of(request_id)


@dataclass(frozen=True)
class Served:
    """An engine behind real servers on 127.0.0.1 (`open_served`, the `served` fixture)."""

    engine: Any
    url: str  # the first app's base URL, no /v1
    urls: dict[str, str] = field(default_factory=dict)  # name -> the other apps' base URLs
    event_log: Path | None = None  # the engine's event log (None: it keeps none)

    def client(self, key: str = "sk-one", url: str | None = None) -> Any:
        """The official OpenAI client of `url` (default: the first app), with `key`."""
        import openai

        base = url or self.url
        return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

    def http(self, url: str | None = None, **kw: Any) -> Any:
        """An httpx client of `url` (default: the first app); `kw` goes to `httpx`."""
        import httpx

        return httpx.AsyncClient(base_url=url or self.url, timeout=60, **kw)

    def flushed_log(self) -> Path:
        """The event log, with every event the engine has appended so far written: its
        writer is a thread of its own, so a response can come back before its events are
        on disk."""
        assert self.event_log is not None, "this engine keeps no event log"
        self.engine.step_loop.event_log.flush()
        return self.event_log


@asynccontextmanager
async def open_served(
    model: str = "stepline-demo",
    *,
    engine: dict[str, Any] | None = None,
    event_log: Path | None = None,
    apps: dict[str, dict[str, Any]] | None = None,
    serve: dict[str, dict[str, Any]] | None = None,
    **app_options: Any,
) -> AsyncIterator[Served]:
    """`model` (128-token steps, unless `engine` says otherwise: `Engine.open`'s options,
    with `event_log`) served in this process: the first app with `app_options`, and one more
    app over the same engine for each of `apps` (name -> `create_app`'s options), each on its
    own port (`serve`: name -> `serve_in_process`'s options; the first app's name is "")."""
    from stepline.api import Engine
    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pipeline.served import OneModel

    every = {"": app_options, **(apps or {})}
    async with (
        Engine.open(
            model, **{"max_step_tokens": 128, **(engine or {})}, event_log=event_log
        ) as opened,
        AsyncExitStack() as stack,
    ):
        urls = {
            name: await stack.enter_async_context(
                serve_in_process(
                    create_app(OneModel(opened), **options), **(serve or {}).get(name, {})
                )
            )
            for name, options in every.items()
        }
        first = urls.pop("")
        yield Served(opened, first, urls, event_log)


# Two function tools' argument schemas, shared by the agent tests of every API. An enum and
# bounded integers: the demo model's forced calls always fit them.
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE_ARGS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}


# Schemas the grammar cannot follow (issue 36), each once served as a 200 with '', '{' or '{"'
# and finish_reason "stop"; and why each is refused.
COUNTED = "^(((a{100}){100}){100})$"  # a string of a million a's: past the lexer's limits
UNFOLLOWABLE = {
    "a $ref loop": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "no output satisfies it",
    ),
    "a $ref to itself": ({"$ref": "#"}, "no output satisfies it"),
    "a recursion that never closes": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"$ref": "#/$defs/node"}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/node",
        },
        "too complex",
    ),
    "an anyOf of 3,000 objects": (
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {f"k{i}": {"type": "integer"}},
                    "required": [f"k{i}"],
                }
                for i in range(3000)
            ]
        },
        "too complex",
    ),
    "a counted pattern": ({"type": "string", "pattern": COUNTED}, "too complex"),
}
# Followable at its start (the model picks a digit first), but whatever it picks, the counted
# pattern that follows is past the lexer's limits: the grammar fails mid-generation.
FAILS_LATER = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "x": {"type": "string", "pattern": COUNTED},
    },
    "required": ["n", "x"],
}


def until(check: Callable[[], T], *, within: float, what: str, every: float = 0.1) -> T:
    """`check()`'s first true value, asked every `every` seconds; AssertionError naming
    `what` after `within` seconds. Only for what another process does (a child's output, its
    HTTP answers), which nothing in this one can signal: in-process code is awaited."""
    deadline = time.monotonic() + within
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:g} s")
        time.sleep(every)  # another process: there is nothing to await
    return value


async def until_async(
    check: Callable[[], Awaitable[T]], *, within: float, what: str, every: float = 0.05
) -> T:
    """`until` for an async `check` (an HTTP request to another process, or to what this one
    serves when the answer depends on no event the code sets)."""
    try:
        with anyio.fail_after(within):
            while not (value := await check()):  # noqa: ASYNC110 - nothing to await
                await anyio.sleep(every)  # seen from outside, as a client
    except TimeoutError:
        raise AssertionError(f"{what}: not within {within:g} s") from None
    return value


def replay(*argv: str) -> tuple[int, str]:
    """`stepline replay ARGV...` in this process: (its exit status, what it printed)."""
    import argparse
    import io

    from stepline.api.cli.replay import add_replay_parser

    parser = argparse.ArgumentParser(prog="stepline")
    add_replay_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", *argv])
    out = io.StringIO()
    code = args.func(args, out=out)
    return code, out.getvalue()


def serve_argv(*options: str) -> list[str]:
    """The command line of `stepline serve` on the demo model (or the `--model` among
    `options`: two would serve both), on a free port, in a child Python process (the one
    running the tests)."""
    import sys

    model = [] if "--model" in options else ["--model", "stepline-demo"]
    return [sys.executable, "-m", "stepline.api.cli", "serve", *model, "--port", "0", *options]


def popen_serve(
    argv: list[str], stderr: Any, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start a `stepline serve` command line (`serve_argv`) with its stdout a text pipe,
    unbuffered, so the lines it prints (the URL, "serving") arrive as printed; `env` is added
    to this process's environment."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def small_config(**extra: Any) -> dict:
    """config.json of a tiny random model of the llama family (2 layers, width 64), with
    `extra` (its vocabulary, the architecture's own keys)."""
    return {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        **extra,
    }


def run_plans(runner: Any, news: tuple, plans: list, *, look_ahead: bool = False) -> list[dict]:
    """Each of `plans` ((chunks, decode request ids) a step) run on a ModelRunner, `news`
    admitted in the first step: every step's sampled tokens (request id -> tokens). No step
    may fail. `look_ahead`: the runner builds the decode batch's next forward after each."""
    from stepline.actors.scheduler.plan import StepPlan
    from stepline.actors.scheduler.work import StepWork

    out = []
    for i, (chunks, decodes) in enumerate(plans):
        num = {rid: 1 for rid in decodes} | {c.request_id: c.num_tokens for c in chunks}
        plan = StepPlan(step=i + 1, decodes=decodes, chunks=chunks, num_scheduled_tokens=num)
        result = runner.run(StepWork(plan=plan, admit=news if i == 0 else ()))
        assert not result.failed
        out.append(dict(result.tokens))
        if look_ahead:
            runner.look_ahead()
    return out
