"""The loop guard through the doors (issue 54): an answer that falls into repeating itself
verbatim ends there (`--loop-guard auto`), with a cap of its own or none, as a length on the
wire (OpenAI's and Ollama's "length", Anthropic's "max_tokens") and as `loop` in the event
log; a request that asks for exactly its length (`ignore_eos`) runs to it; an answer that
does not loop is the same token for token with the guard or without. The demo model (random
weights) at greedy falls into a loop on `LOOPING`: a deterministic looping answer. Real
servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx
import pytest
import pytest_asyncio
from helpers import Served, hold_open, open_served, replay, wait_finished

from stepline.actors.scheduler.loop_guard import MIN_TOKENS
from stepline.api import SamplingParams
from stepline.events.log import read_events
from stepline.events.models import Terminal

IN_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

CAP = 600  # the server's default cap here: well past where the loop is found
LOOPING = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory) -> AsyncIterator[Served]:
    """The demo model with an event log, served with the default cap CAP three ways: as it
    comes (--loop-guard auto), with --loop-guard off ("off") and on ("on")."""
    log = tmp_path_factory.mktemp("loops") / "events.jsonl"
    apps = {
        "off": {"loop_guard": "off", "default_max_tokens": CAP},
        "on": {"loop_guard": "on", "default_max_tokens": CAP},
    }
    value, close = await hold_open(open_served(event_log=log, apps=apps, default_max_tokens=CAP))
    try:
        yield value
    finally:
        await close()


def _terminal(served: Served, rid: str) -> Terminal:
    events = read_events(served.flushed_log())
    (end,) = [e for e in events if isinstance(e, Terminal) and e.request_id == rid]
    return end


async def _chat(served: Served, url: str | None = None, **body) -> tuple[dict, str]:
    async with served.http(url) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={"model": served.engine.model_name, "messages": LOOPING, **GREEDY, **body},
        )
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    await wait_finished(served.engine.step_loop, rid)
    return r.json(), rid


@IN_MODULE_LOOP
async def test_a_looping_answer_with_no_cap_ends_as_a_length_and_the_log_says_loop(served):
    body, rid = await _chat(served)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    n = body["usage"]["completion_tokens"]
    assert MIN_TOKENS <= n < CAP
    assert _terminal(served, rid).reason == "loop"
    text = choice["message"]["content"]
    tail = text[-40:]
    assert text[:-40].count(tail) >= 1  # what it ended on it had said before, verbatim


@IN_MODULE_LOOP
async def test_a_request_with_its_own_max_tokens_is_guarded_too_and_ignore_eos_runs_to_it(
    served,
):
    looped, _ = await _chat(served)
    capped, capped_rid = await _chat(served, max_tokens=CAP - 1)
    # a cap is no ask for a loop (Open WebUI's title job sends max_tokens 1000)
    assert capped["choices"][0]["message"]["content"] == looped["choices"][0]["message"]["content"]
    assert capped["usage"]["completion_tokens"] < CAP - 1
    assert _terminal(served, capped_rid).reason == "loop"
    exact, rid = await _chat(served, max_tokens=CAP - 1, ignore_eos=True)
    assert exact["usage"]["completion_tokens"] == CAP - 1
    assert exact["choices"][0]["finish_reason"] == "length"
    assert _terminal(served, rid).reason == "length"
    # the same tokens up to where the guard ended the other
    head = looped["choices"][0]["message"]["content"]
    assert exact["choices"][0]["message"]["content"].startswith(head)


@IN_MODULE_LOOP
async def test_a_streamed_looping_answer_ends_with_finish_reason_length(served):
    reasons, usage = [], None
    async with served.client() as client:
        stream = await client.chat.completions.create(
            model=served.engine.model_name,
            messages=LOOPING,  # type: ignore[arg-type]
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
    assert reasons == ["length"]
    assert usage is not None and usage.completion_tokens < CAP


@IN_MODULE_LOOP
async def test_ollama_s_chat_ends_a_loop_with_done_reason_length_with_num_predict_or_without(
    served,
):
    async with served.http() as http:
        bodies = [
            {"temperature": 0},
            {"temperature": 0, "num_predict": CAP - 1},
        ]
        replies = [
            await http.post(
                "/api/chat",
                json={
                    "model": served.engine.model_name,
                    "messages": LOOPING,
                    "stream": False,
                    "options": options,
                },
            )
            for options in bodies
        ]
    for r in replies:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["done_reason"] == "length" and body["eval_count"] < CAP - 1
        assert _terminal(served, r.headers["x-request-id"]).reason == "loop"


@IN_MODULE_LOOP
async def test_with_the_guard_off_the_loop_runs_to_the_default_cap(served):
    body, rid = await _chat(served, served.urls["off"])
    assert body["usage"]["completion_tokens"] == CAP
    assert _terminal(served, rid).reason == "length"


@IN_MODULE_LOOP
async def test_an_anthropic_answer_always_capped_ends_a_loop_as_max_tokens(served):
    async with anthropic.AsyncAnthropic(
        base_url=served.url, api_key="sk-one", max_retries=0
    ) as client:
        message = await client.messages.create(
            model=served.engine.model_name,
            max_tokens=CAP,
            messages=LOOPING,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens < CAP


@IN_MODULE_LOOP
async def test_with_the_guard_on_an_ignore_eos_answer_ends_its_loop_too(served):
    body, rid = await _chat(served, served.urls["on"], max_tokens=CAP - 1, ignore_eos=True)
    assert body["usage"]["completion_tokens"] < CAP - 1
    assert _terminal(served, rid).reason == "loop"


@IN_MODULE_LOOP
async def test_an_answer_that_does_not_loop_is_the_same_with_the_guard_or_without(served):
    engine = served.engine
    answers = []
    for guard in (False, True):
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=3, loop_guard=guard)
        outs = [o async for o in engine.generate(messages=LOOPING, params=params)]
        answers.append(([t for o in outs for t in o.token_ids], outs[-1].finish_reason))
    assert answers[0] == answers[1]
    assert answers[1][1] in ("stop", "length") and len(answers[1][0]) > 2 * MIN_TOKENS


@IN_MODULE_LOOP
async def test_a_log_with_loops_verifies(served):
    code, out = replay(str(served.flushed_log()), "--verify")
    assert code == 0, out


@IN_MODULE_LOOP
async def test_the_doors_record_whether_a_request_is_guarded_and_its_penalty_window(served):
    async with httpx.AsyncClient(base_url=served.url) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": LOOPING, "max_tokens": 2, "repeat_last_n": 16},
        )
        exact = await http.post(
            "/v1/chat/completions",
            json={"messages": LOOPING, "max_tokens": 2, "ignore_eos": True},
        )
    state = await wait_finished(served.engine.step_loop, r.headers["x-request-id"])
    assert state.params.loop_guard and state.params.repeat_last_n == 16
    state = await wait_finished(served.engine.step_loop, exact.headers["x-request-id"])
    assert not state.params.loop_guard


async def test_a_loop_the_python_api_asked_to_guard_ends_as_loop_and_reexecutes_the_same(
    tmp_path,
):
    from stepline.api import Engine
    from stepline.api.reexecute import reexecute

    log = tmp_path / "run.jsonl"
    params = SamplingParams(max_tokens=CAP, temperature=0, loop_guard=True)
    async with Engine.open("stepline-demo", max_step_tokens=128, event_log=log) as engine:
        outs = [o async for o in engine.generate(messages=LOOPING, params=params)]
    assert outs[-1].finish_reason == "loop"
    assert MIN_TOKENS <= outs[-1].num_output_tokens < CAP

    report = await reexecute(log)

    assert (report.num_same, report.num_diverged, report.num_skipped) == (1, 0, 0)
