"""A background response cut off by a crash: the restarted server, on the same event log,
answers for it with `failed` and the reason (the official `openai` client, real HTTP).

The crash is the log file as it stands while the response runs: a copy taken then is what
a kill -9 leaves on disk (every event written so far, no ending)."""

from __future__ import annotations

import shutil

import anyio
import openai
import pytest
from helpers import wait_until

from stepline.actors.messages import SHUTDOWN_MESSAGE
from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel
from stepline.api.responses.recovery import interrupted_responses
from stepline.events.log import read_events
from stepline.events.models import Terminal

pytestmark = pytest.mark.asyncio

MODEL = "stepline-demo"


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def wait_admitted(engine: Engine, rid: str) -> None:
    """Until the step loop has admitted `rid` and the log writer has written its admission."""
    loop = engine.step_loop
    await wait_until(loop, lambda: loop.state_of(rid) is not None)
    await anyio.to_thread.run_sync(loop.event_log.flush)


async def test_a_background_response_cut_off_by_a_crash_reports_failed_after_the_restart(
    demo, tmp_path
):
    log, crashed = tmp_path / "events.jsonl", tmp_path / "crashed.jsonl"
    async with Engine.open(MODEL, max_step_tokens=128, event_log=log) as engine:
        async with serve_in_process(create_app(OneModel(engine))) as url, client(url, "sk-a") as c:
            done = await c.responses.create(model=MODEL, input="Hi.", max_output_tokens=4)
            running = await c.responses.create(
                model=MODEL,
                input="Tell me about rye.",
                max_output_tokens=engine.max_context - 64,
                background=True,
                extra_body={"ignore_eos": True},
            )
            await wait_admitted(engine, running.id)
            shutil.copy(log, crashed)  # the disk as a kill -9 would leave it
            await c.responses.cancel(running.id)

    interrupted = interrupted_responses(crashed, since=0)
    assert [rid for rid, _ in interrupted] == [running.id]
    async with Engine.open(MODEL, max_step_tokens=128, event_log=crashed) as engine:
        app = create_app(OneModel(engine), interrupted_responses=interrupted)
        async with serve_in_process(app) as url, client(url, "sk-a") as c:
            after = await c.responses.retrieve(running.id)
            stream = await c.responses.retrieve(running.id, stream=True)
            events = [e async for e in stream]
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(done.id)  # its output was in memory only
            with pytest.raises(openai.BadRequestError, match="only a completed"):
                await c.responses.create(
                    model=MODEL, input="Go on.", previous_response_id=running.id
                )
    assert after.status == "failed"
    assert after.error.code == "server_restarted"
    assert "stopped before this response finished" in after.error.message
    assert [e.type for e in events] == ["response.failed"]
    assert events[0].sequence_number == 0


async def test_no_log_yet_means_nothing_was_cut_off(tmp_path):
    assert interrupted_responses(tmp_path / "none.jsonl", since=0) == []


async def test_a_background_response_cut_off_by_a_graceful_shutdown_is_recovered_too(
    demo, tmp_path
):
    log = tmp_path / "events.jsonl"
    async with Engine.open(MODEL, max_step_tokens=128, event_log=log) as engine:
        async with (
            serve_in_process(create_app(OneModel(engine)), graceful_shutdown_s=0.2) as url,
            client(url, "sk-a") as c,
        ):
            running = await c.responses.create(
                model=MODEL,
                input="Tell me about oats.",
                max_output_tokens=engine.max_context - 64,
                background=True,
                extra_body={"ignore_eos": True},
            )
            await wait_admitted(engine, running.id)
        # The server stopped; the engine stops now, with the response still running.
    assert [rid for rid, _ in interrupted_responses(log, since=0)] == [running.id]


async def test_a_server_stop_cancels_a_background_response_as_the_engines_stop(demo, tmp_path):
    """`stepline serve` begins its stop with `begin_shutdown` (open streams end at once): a
    background response it ends is logged as the engine's stop, not the client's cancel, so
    the next start recovers it."""
    log = tmp_path / "events.jsonl"
    async with Engine.open(MODEL, max_step_tokens=128, event_log=log) as engine:
        models = OneModel(engine)
        async with serve_in_process(create_app(models)) as url, client(url, "sk-a") as c:
            running = await c.responses.create(
                model=MODEL,
                input="Tell me about barley.",
                max_output_tokens=engine.max_context - 64,
                background=True,
                extra_body={"ignore_eos": True},
            )
            await wait_admitted(engine, running.id)
            assert models.begin_shutdown() == 1  # what the server's stop calls first
            await wait_until(engine.step_loop, lambda: not engine.step_loop.states)
    ends = [e for e in read_events(log) if isinstance(e, Terminal)]
    assert [(e.request_id, e.message) for e in ends] == [(running.id, SHUTDOWN_MESSAGE)]
    assert [rid for rid, _ in interrupted_responses(log, since=0)] == [running.id]
