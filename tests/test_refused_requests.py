"""Requests refused at a door (400, 404, 413, 429): each is one lone `terminal` in the event
log (reason rejected, the error's code and HTTP status, nothing of its prompt), folded,
verified and counted by replay as a rejected request; one the engine refuses after looking
at its prompt stays `admitted` then `terminal`.

The HTTP tests drive a real uvicorn on 127.0.0.1 with the official `openai` client."""

from __future__ import annotations

import json
import warnings
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from core_driver import make_core, params
from helpers import Served, replay, wait_finished, wait_until
from log_builder import LogBuilder

from stepline.actors.scheduler.admission import QueueFullError, Refusal
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.api.config import EventLogConfig, ModelSpec, PoolConfig
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pool import ModelPool
from stepline.api.refusals import REFUSAL_STATUS
from stepline.events.fold import FoldError, Status, fold
from stepline.events.log import TornLineWarning, read_events
from stepline.events.models import Admitted, FinishReason, Terminal
from stepline.events.replay import (
    UnknownRequestError,
    request_timeline,
    state_at_step,
    summarize,
    verify,
)
from stepline.events.replay.reexecute import load_recorded_run
from stepline.events.replay.svg import render_svg

# -- the fold and the scheduler core (no model) ------------------------------------------------


def test_a_lone_rejected_terminal_folds_to_a_request_that_ended_where_it_arrived() -> None:
    b = LogBuilder()
    b.refuse("door-1", "invalid_value", 400)

    state = fold(b.events)["door-1"]
    assert state.status is Status.FINISHED and state.finish_reason is FinishReason.REJECTED
    assert not state.admitted
    assert (state.num_prompt_tokens, state.num_computed_tokens, state.num_output_tokens) == (
        0,
        0,
        0,
    )
    assert state.prompt_token_ids is None and state.params.max_tokens == 0


def test_a_lone_terminal_that_is_no_refusal_is_still_an_unknown_request() -> None:
    b = LogBuilder()
    b.end("ghost", FinishReason.STOP)

    with pytest.raises(FoldError) as err:
        fold(b.events)
    assert err.value.kind == "unknown-request"


def test_the_core_records_a_refusal_once_and_its_state_is_the_folds() -> None:
    core = make_core()
    refused = core.refuse("chatcmpl-1", "temperature: too high", code="invalid_value", status=400)

    assert refused is not None and (refused.code, refused.status) == ("invalid_value", 400)
    events = core.take_events()
    assert events == [refused]  # no admission before it
    assert fold(events)["chatcmpl-1"] == core.state_of("chatcmpl-1")
    assert not core.states and core.housekeeping() is None  # nothing for the executor
    # An id the core has seen is not refused again, nor admitted later.
    assert core.refuse("chatcmpl-1", "again", code="invalid_value", status=400) is None
    core.add("r1", (3, 4), params())
    assert core.refuse("r1", "late", code="invalid_value", status=400) is None
    assert [e.type for e in core.take_events()] == ["admitted"]


def test_a_full_queue_refuses_with_a_lone_terminal_naming_429_and_nothing_of_the_prompt() -> None:
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=1, max_waiting=1, max_step_ms=None)
    core = make_core(config=config, refusal_status=REFUSAL_STATUS)  # as the server builds it
    core.add("waits", (3,), params())
    with pytest.raises(QueueFullError):
        core.add("one-too-many", (3, 4, 5), params())

    events = [e for e in core.take_events() if e.request_id == "one-too-many"]
    assert [(e.type, e.code, e.status) for e in events] == [("terminal", "queue_full", 429)]
    assert core.state_of("one-too-many").finish_reason is FinishReason.REJECTED


def test_a_core_told_no_statuses_records_a_refusal_by_its_kind_alone() -> None:
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=1, max_waiting=1, max_step_ms=None)
    core = make_core(config=config)
    core.add("waits", (3,), params())
    with pytest.raises(QueueFullError) as refused:
        core.add("one-too-many", (3, 4, 5), params())

    assert refused.value.refusal is Refusal.QUEUE_FULL
    (event,) = [e for e in core.take_events() if e.request_id == "one-too-many"]
    assert (event.type, event.code, event.status) == ("terminal", "queue_full", None)


# -- replay of a log that holds refusals (hand-made) -------------------------------------------


def served_and_refused() -> LogBuilder:
    """r1 served (stop) between two refusals: a 400 and a 413."""
    b = LogBuilder(step_every=0.1)
    b.refuse("bad-params", "invalid_value", 400)
    b.admit("r1", 2)
    b.do_step(prefill={"r1": (0, 2)})
    b.end("r1", FinishReason.STOP)
    b.refuse("too-big", "request_too_large", 413)
    return b


def test_replay_counts_refusals_as_rejected_and_verifies_the_log(tmp_path: Path) -> None:
    path = served_and_refused().write(tmp_path / "run.jsonl")

    assert summarize(path).outcomes == {"rejected": 2, "stop": 1}
    code, text = replay(str(path))
    assert code == 0 and "requests: 3 (2 rejected, 1 stop)" in text
    report = verify(path)
    assert report.ok and report.num_requests == 3
    at_end = state_at_step(path, 9)
    assert at_end.counts == {"finished": 3}
    assert "finished: rejected, 0 tokens" in [r.description for r in at_end.requests]


def test_asking_for_a_refused_request_says_it_was_refused_and_why(tmp_path: Path, capsys) -> None:
    path = served_and_refused().write(tmp_path / "run.jsonl")

    with pytest.raises(UnknownRequestError, match="refused before it was admitted"):
        request_timeline(path, "too-big")
    assert replay(str(path), "--request", "too-big")[0] == 2
    assert "(413 request_too_large: refused: request_too_large)" in capsys.readouterr().err


def test_pictures_traces_and_reexecution_leave_refusals_out(tmp_path: Path) -> None:
    path = served_and_refused().write(tmp_path / "run.jsonl")
    trace = tmp_path / "trace.json"

    assert render_svg(path).count('class="request"') == 1
    assert replay(str(path), "--trace", str(trace))[0] == 0
    assert "too-big" not in trace.read_text() and "r1" in trace.read_text()
    assert [r.admitted.request_id for r in load_recorded_run(path).requests] == ["r1"]


# -- over HTTP ----------------------------------------------------------------------------------

MAX_BODY_BYTES = 16 * 1024
SECRET = "the-prompt-nobody-may-log"


@pytest.fixture(scope="module")
def served_options() -> dict:
    # One running slot and one waiting: a third request finds the queue full. KV for 1,024
    # tokens: a request that asks for more is refused by the engine itself. Beside the default
    # app, the same engine with strict_max_tokens ("strict": past its KV budget, refused).
    return dict(
        engine=dict(max_num_seqs=1, max_waiting=1, max_kv_tokens=1024),
        event_log=True,
        max_body_bytes=MAX_BODY_BYTES,
        apps={"strict": dict(strict_max_tokens=True)},
    )


async def logged(served: Served) -> list:
    """Every event of the served engine's log so far."""
    await anyio.to_thread.run_sync(served.engine.step_loop.event_log.flush)
    assert served.event_log is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornLineWarning)  # the writer may be mid-line
        return list(read_events(served.event_log))


async def lone_terminal(served: Served, request_id: str) -> Terminal:
    """The request's one event: its terminal, with no admission before it."""
    mine = [e for e in await logged(served) if e.request_id == request_id]
    assert [e.type for e in mine] == ["terminal"], mine
    return mine[0]


http_tests = pytest.mark.asyncio(loop_scope="module")


def chat(content: str, **extra) -> dict:
    return {"model": "stepline-demo", "messages": [{"role": "user", "content": content}], **extra}


@http_tests
async def test_bad_parameters_get_a_400_and_leave_a_lone_rejected_terminal(served) -> None:
    async with served.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**chat(SECRET, temperature=-1.0))
    rid = err.value.response.headers["x-request-id"]

    terminal = await lone_terminal(served, rid)
    assert terminal.reason is FinishReason.REJECTED
    assert (terminal.code, terminal.status) == ("invalid_value", 400)
    assert "temperature" in (terminal.message or "")
    assert SECRET not in served.event_log.read_text()


@http_tests
async def test_a_body_over_the_limit_gets_a_413_and_leaves_a_lone_rejected_terminal(served) -> None:
    async with served.client() as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(**chat(SECRET * 1000))
    assert err.value.status_code == 413
    rid = err.value.response.headers["x-request-id"]

    terminal = await lone_terminal(served, rid)
    assert (terminal.reason, terminal.code, terminal.status) == (
        FinishReason.REJECTED,
        "request_too_large",
        413,
    )
    assert SECRET not in served.event_log.read_text()


@http_tests
async def test_an_unknown_model_gets_a_404_and_leaves_a_lone_rejected_terminal(served) -> None:
    async with served.client() as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(**chat(SECRET, model="gpt-4"))

    terminal = await lone_terminal(served, err.value.response.headers["x-request-id"])
    assert (terminal.code, terminal.status) == ("model_not_found", 404)


@http_tests
async def test_an_unknown_model_s_long_name_is_cut_in_the_reply_and_the_logs(served) -> None:
    from structlog.testing import capture_logs

    name = "m" * 10_000  # past any sane name (the body limit here is 16 KiB)
    assert served.event_log is not None
    before = served.event_log.stat().st_size
    with capture_logs() as logs:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json=chat("hi", model=name))
            card = await http.get(f"/v1/models/{'m' * 20_000}")
    assert (r.status_code, card.status_code) == (404, 404)
    assert len(r.content) < 1_000 and len(card.content) < 1_000
    message = r.json()["error"]["message"]
    assert "m" * 256 in message and "(10,000 characters)" in message
    terminal = await lone_terminal(served, r.headers["x-request-id"])
    assert len(terminal.message or "") < 1_000
    assert served.event_log.stat().st_size - before < 10_000  # the event log's lines too
    assert all(len(repr(entry)) < 1_500 for entry in logs)  # and the server's


@http_tests
async def test_a_full_queue_gets_a_429_and_leaves_a_lone_rejected_terminal(served) -> None:
    loop = served.engine.step_loop
    long = {"max_tokens": 900, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(base_url=served.url, timeout=60) as http,
        AsyncExitStack() as streams,
        served.client() as client,
    ):

        async def open_stream(body: dict) -> str:
            r = await streams.enter_async_context(
                http.stream("POST", "/v1/chat/completions", json=body)
            )
            assert r.status_code == 200
            return r.headers["x-request-id"]

        # One request runs (its 900 tokens hold the one slot), one waits: the queue is full.
        running = await open_stream(chat("a long tale", **long))
        await wait_until(loop, lambda: loop.state_of(running).status is Status.DECODING)
        waiting = await open_stream(chat("a short tale", **long))
        await wait_until(loop, lambda: loop.state_of(waiting).status is Status.WAITING)
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(**chat(SECRET, max_tokens=4))
        assert err.value.response.headers["retry-after"]
        await streams.aclose()  # both hang up: cancelled
        for rid in (running, waiting):
            await wait_finished(loop, rid)

    terminal = await lone_terminal(served, err.value.response.headers["x-request-id"])
    assert (terminal.reason, terminal.code, terminal.status) == (
        FinishReason.REJECTED,
        "queue_full",
        429,
    )
    assert SECRET not in served.event_log.read_text()


@http_tests
async def test_a_request_the_engine_refuses_is_still_admitted_then_rejected_once(served) -> None:
    # Strict max_tokens: 1,500 tokens fit the context but never the 1,024-token KV budget.
    async with served.client(url=served.urls["strict"]) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**chat("hello", max_tokens=1500))
    rid = err.value.response.headers["x-request-id"]

    mine = [e for e in await logged(served) if e.request_id == rid]
    assert [e.type for e in mine] == ["admitted", "terminal"]
    assert isinstance(mine[0], Admitted) and mine[1].reason is FinishReason.REJECTED
    assert "KV" in (mine[1].message or "")


@http_tests
async def test_stepline_replay_counts_the_refused_requests_and_finds_the_log_sound(
    served,
) -> None:
    async with served.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(**chat("hi", top_p=7.0))
        reply = await client.chat.completions.create(**chat("hi", max_tokens=2))
    await wait_finished(served.engine.step_loop, reply.id)
    events = await logged(served)
    rejected = sum(isinstance(e, Terminal) and e.reason is FinishReason.REJECTED for e in events)

    code, text = replay(str(served.event_log), "--json")
    assert code == 0 and json.loads(text)["outcomes"]["rejected"] == rejected
    code, text = replay(str(served.event_log), "--verify")
    assert code == 0, text


# -- a server of several models -----------------------------------------------------------------


async def test_a_pool_logs_a_refusal_before_any_model_under_the_run_and_replay_reads_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "pool.jsonl"
    config = PoolConfig(models=(ModelSpec(name="a", model="stepline-demo"),))
    with anyio.fail_after(60):
        async with (
            ModelPool.open(config, {}, EventLogConfig(event_log=str(log))) as pool,
            serve_in_process(create_app(pool)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client,
        ):
            for _ in range(2):  # no model is loaded for either
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(**chat(SECRET, model="zz"))

    refused = [e for e in read_events(log) if isinstance(e, Terminal)]
    assert [(e.model, e.seq, e.code, e.status) for e in refused] == [
        (None, 1, "model_not_found", 404),
        (None, 2, "model_not_found", 404),
    ]
    assert SECRET not in log.read_text()
    code, text = replay(str(log), "--verify")
    assert code == 0, text
    code, text = replay(str(log))
    assert code == 0 and "requests: 2 (2 rejected)" in text
