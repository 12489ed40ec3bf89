"""`Engine.submit` with arguments of the wrong type or value: each is a TypeError or
ValueError naming the argument, raised at once; the engine serves on and its event log
stays whole (each would otherwise end the engine with a gap in the log, or degrade it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from stepline.api import Engine, SamplingParams, WrongEventLoopError
from stepline.api.json_limits import MAX_STOP_STRINGS
from stepline.events.log import read_events
from stepline.events.replay.verify import verify

BAD_ARGS = [
    ({"checkpoints": [2.5]}, TypeError, "checkpoints"),
    ({"checkpoints": ["3"]}, TypeError, "checkpoints"),
    ({"checkpoints": [True]}, TypeError, "checkpoints"),
    ({"checkpoints": "3"}, TypeError, "checkpoints"),
    ({"checkpoints": [-1]}, ValueError, "checkpoints"),
    ({"request_id": 5}, TypeError, "request_id"),
    ({"request_id": b"x"}, TypeError, "request_id"),
    ({"request_id": "\ud800"}, ValueError, "request_id"),
    ({"request_id": ""}, ValueError, "request_id"),
    ({"request_id": "x" * 257}, ValueError, "request_id"),
    ({"params": {"max_tokens": 2}}, TypeError, "params"),
    ({"template_kwargs": [1]}, TypeError, "template_kwargs"),
    ({"client": 5}, TypeError, "client"),
    ({"client": ""}, ValueError, "client"),
    ({"client": "\ud800"}, ValueError, "client"),
    ({"client": "c" * 257}, ValueError, "client"),
]


@pytest.mark.asyncio
async def test_wrong_arguments_are_refused_naming_them_and_the_engine_serves_on(
    demo, tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    async with Engine.open("stepline-demo", max_step_tokens=128, event_log=path) as engine:
        for kwargs, error, name in BAD_ARGS:
            with pytest.raises(error, match=name):
                await engine.submit([1, 2, 3, 4], **kwargs)
        outs = [
            out
            async for out in engine.generate(
                [1, 2, 3, 4], params=SamplingParams(max_tokens=3), request_id="after"
            )
        ]
        assert engine.healthy and engine.event_log_problem is None
    assert outs[-1].finish_reason == "length"
    assert verify(path).ok
    assert {e.request_id for e in read_events(path) if e.request_id} == {"after"}


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"stop": ["\ud800"]}, "surrogate"),
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"grammar": "start: \udfff"}, "surrogate"),
        ({"stop": ["a" * 1001]}, "at most 1000"),
    ],
)
def test_sampling_params_refuse_what_the_log_could_not_record(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


@pytest.mark.asyncio
async def test_a_request_from_another_threads_event_loop_is_refused_at_once(demo) -> None:
    async with Engine.open("stepline-demo", max_step_tokens=128) as engine:

        async def elsewhere() -> None:
            async for _ in engine.generate([1, 2, 3], params=SamplingParams(max_tokens=2)):
                pass

        def other_thread() -> BaseException | None:
            try:
                asyncio.run(elsewhere())
            except BaseException as exc:
                return exc
            return None

        with anyio.fail_after(10):  # not forever: its answers could never reach it
            error = await anyio.to_thread.run_sync(other_thread)
        assert isinstance(error, WrongEventLoopError)
        assert "run_coroutine_threadsafe" in str(error)
        outs = [o async for o in engine.generate([1, 2, 3], params=SamplingParams(max_tokens=2))]
        assert outs[-1].finish_reason == "length" and engine.healthy
