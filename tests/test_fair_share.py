"""Fair share between clients: one client's many requests do not keep another's from the next
free slot, nor fill the waiting queue. The policy without a model (tests/core_driver.py,
states built by the fold), then over HTTP on the demo model."""

from __future__ import annotations

import json
import random
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import httpx
import pytest
from core_driver import TOKEN, make_core, params, run_step
from helpers import DEMO_LARGE_COST, wait_until
from starlette.datastructures import Headers

from stepline.actors.scheduler.admission import QueueFullError
from stepline.actors.scheduler.order import MAX_WAIT_STEPS, fair_order, is_aged
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_candidates import prefix_candidates
from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.errors import known_error
from stepline.api.pipeline.served import OneModel
from stepline.api.pipeline.serving import client_of
from stepline.events.fold import RequestState, Status, fold
from stepline.events.log import read_events
from stepline.events.models import Admitted, ChunkPrefilled, Parked, Terminal, TokensSampled

COST = DEMO_LARGE_COST  # roughly stepline-demo-large on a CPU (helpers.py)


def started_order(core, until: str, max_steps: int = 100) -> list[str]:
    """Run the core's steps until request `until` gets its first chunk; the requests in the
    order their first chunks came."""
    started: list[str] = []
    for _ in range(max_steps):
        work, _ = run_step(core)
        started += [c.request_id for c in work.plan.chunks if c.start == 0]
        if until in started:
            return started
    raise AssertionError(f"{until} never started: {started}")


# -- the policy -------------------------------------------------------------------------------


@pytest.mark.parametrize("cost", [None, COST], ids=["tokens", "timed"])
def test_a_client_running_its_share_waits_while_another_clients_request_waits(cost):
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_step_ms=100 if cost else None)
    core = make_core(config=config, cost=cost)
    # Client a takes every slot (a0 ends first) and queues 16 more, shorter than b's prompt.
    core.add("a0", range(2), params(12), client="a")
    for i in range(1, 4):
        core.add(f"a{i}", range(2), params(1000), client="a")
    for i in range(4, 20):
        core.add(f"a{i}", range(3), params(3), client="a")
    for _ in range(10):  # a's queue ages past MAX_WAIT_STEPS; nobody else waits
        run_step(core)
    assert is_aged(core.states["a4"], core.step + 1)
    core.add("b", range(20), params(3), client="b")

    # When a0 ends, b gets its slot: before a's aged and shorter prompts.
    assert started_order(core, "b") == ["b"]
    assert core.state_of("a0").is_finished
    assert core.states["b"].status is Status.DECODING
    assert all(core.states[f"a{i}"].status is Status.WAITING for i in range(4, 20))


def test_without_fair_share_the_same_queue_would_go_first():
    # The test above, with b from client a: a's aged prompts go first, as they always did.
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_step_ms=None))
    core.add("a0", range(2), params(12), client="a")
    for i in range(1, 4):
        core.add(f"a{i}", range(2), params(1000), client="a")
    for i in range(4, 20):
        core.add(f"a{i}", range(3), params(3), client="a")
    for _ in range(10):
        run_step(core)
    core.add("b", range(20), params(3), client="a")
    assert started_order(core, "a4") == ["a4"]


def test_free_slots_of_one_step_are_shared_between_the_clients_that_wait():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_num_seqs=3, max_step_ms=None))
    for i in range(3):
        core.add(f"a{i}", range(2), params(), client="a")
    core.add("b", range(10), params(), client="b")
    # A share is 3 / 2 slots: a gets two (shortest first), b one, a2 waits.
    plan = run_step(core)[0].plan
    assert [c.request_id for c in plan.chunks] == ["a0", "a1", "b"]
    assert core.states["a2"].status is Status.WAITING


def test_with_one_client_waiting_the_order_is_the_one_it_always_was():
    rng = random.Random(7)
    requests = [(rng.randint(1, 60), rng.randint(1, 6)) for _ in range(30)]

    def plans(other: str | None) -> list:
        config = SchedulerConfig(max_step_tokens=32, max_num_seqs=4, max_step_ms=None)
        core = make_core(config=config)
        core.add("b", range(5), params(200), client=other)  # runs while a's requests come
        run_step(core)
        for i, (n, max_tokens) in enumerate(requests):
            core.add(f"a{i}", range(n), params(max_tokens), client="a")
        out = []
        while any(s.request_id != "b" for s in core.states.values()):
            out.append(run_step(core)[0].plan)
        return out

    # b, running, is another client or not: only a waits, so nothing changes.
    assert plans("b") == plans("a") == plans(None)


def _states(requests: list[tuple[str, str, bool]]) -> dict[str, RequestState]:
    """States the fold makes of (request id, client, running), in arrival order: a running
    one is decoding, the others wait; every prompt is 4 tokens."""
    events: list = []

    def add(cls, **fields) -> None:
        events.append(cls(seq=len(events) + 1, ts=0.0, step=1, **fields))

    for rid, client, running in requests:
        add(
            Admitted,
            request_id=rid,
            num_prompt_tokens=4,
            prompt_token_ids=(5, 6, 7, 8),
            prompt_sha256="x",
            params=params(100),
            client=client,
        )
        if running:
            add(ChunkPrefilled, request_id=rid, start=0, end=4)
            add(TokensSampled, request_ids=(rid,), token_ids=(TOKEN,))
    return fold(events)


def test_requests_held_back_go_the_client_with_fewer_running_first():
    # 7 slots, 3 clients: a share of 7/3. a runs 3, b 2, c 1; a and b wait.
    running = [("ra0", "a"), ("ra1", "a"), ("ra2", "a"), ("rb0", "b"), ("rb1", "b"), ("rc", "c")]
    waiting = [("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b")]
    states = _states([(r, c, True) for r, c in running] + [(r, c, False) for r, c in waiting])
    prompts = [(states[r], 0) for r, _ in waiting]
    order = [s.request_id for s, _ in fair_order(prompts, list(states.values()), 7)]
    # b1 starts within b's share; then a1 and b2 (each client's 4th), then a2 (a's 5th).
    assert order == ["b1", "a1", "b2", "a2"]


def test_the_prefix_plan_looks_at_the_request_fair_share_starts_next():
    # a runs every slot and queues more than a slot's worth: b's request is still among
    # the waiting requests whose cache hits are looked up (else it could never start).
    requests = [(f"r{i}", "a", True) for i in range(4)]
    requests += [(f"q{i}", "a", False) for i in range(10)] + [("b", "b", False)]
    states = _states(requests)
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_step_ms=None)
    step = 1 + MAX_WAIT_STEPS  # a's queue has aged
    candidates = prefix_candidates(states, lambda rid: (5, 6, 7, 8), step, config, set())
    assert [c.request_id for c in candidates] == ["b", "q0", "q1", "q2"]


# -- the waiting queue ------------------------------------------------------------------------


def test_one_client_fills_at_most_three_quarters_of_the_waiting_queue():
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=1, max_waiting=8, max_step_ms=None)
    assert config.max_waiting_per_client == 6
    core = make_core(config=config)
    for i in range(6):
        core.add(f"a{i}", (3,), params(), client="a")
    with pytest.raises(QueueFullError, match="this client already has 6 requests") as err:
        core.add("a6", (3,), params(), client="a")
    assert err.value.per_client
    core.add("b0", (3,), params(), client="b")  # the rest is kept for the others
    core.add("anon", (3,), params())
    with pytest.raises(QueueFullError, match="queue is full") as full:
        core.add("b1", (3,), params(), client="b")
    assert not full.value.per_client
    events = core.take_events()
    refused = {e.request_id for e in events if isinstance(e, Terminal)}
    assert refused == {"a6", "b1"}
    clients = {
        e.request_id: e.client for e in events if isinstance(e, Admitted) and e.origin == "client"
    }
    assert clients["a0"] == "a" and clients["b0"] == "b" and clients["anon"] is None


def test_a_small_queue_keeps_nothing_back():
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=1, max_waiting=3, max_step_ms=None)
    assert config.max_waiting_per_client == 3


async def test_a_client_past_its_share_of_the_queue_is_told_it_is_its_own_share():
    err = known_error(QueueFullError(6, 6, retry_after_s=1.0, per_client=True))
    assert err is not None and err.status_code == 429 and err.code == "queue_full"
    assert err.message.startswith("you have 6 requests waiting, the most one client may have")
    assert err.headers == {"retry-after": "1"}


# -- who a client is --------------------------------------------------------------------------


def test_a_client_is_its_key_and_its_user_as_fingerprints():
    keyed = Headers({"authorization": "Bearer sk-secret"})
    same_key = Headers({"x-api-key": "sk-secret"})
    other = Headers({"authorization": "Bearer sk-other"})
    none = Headers({})
    assert client_of(keyed) == client_of(same_key) != client_of(other)
    assert client_of(keyed, "alice") != client_of(keyed, "bob") != client_of(keyed)
    assert client_of(none, "alice") != client_of(keyed, "alice")
    assert client_of(none) is None and client_of(none, "") is None
    for client in (client_of(keyed, "alice"), client_of(none, "alice@example.com")):
        assert client is not None and "secret" not in client and "alice" not in client
    key, user = client_of(keyed, "alice").split()
    assert key.startswith("key:") and user.startswith("user:")


def test_a_version_3_log_loads_with_every_request_from_the_anonymous_client(tmp_path: Path):
    path = tmp_path / "v3.jsonl"
    header = {"type": "header", "schema_version": 3, "created": 1.0}
    admitted = {
        "seq": 1,
        "ts": 1.0,
        "step": 1,
        "type": "admitted",
        "request_id": "r",
        "num_prompt_tokens": 2,
        "prompt_token_ids": [5, 6],
        "prompt_sha256": "x",
        "params": params().model_dump(mode="json"),
    }
    path.write_text(f"{json.dumps(header)}\n{json.dumps(admitted)}\n", encoding="utf-8")
    (event,) = read_events(path)
    assert isinstance(event, Admitted) and event.client is None
    assert fold([event])["r"].client is None


# -- over HTTP ---------------------------------------------------------------------------------


def chat(text: str, max_tokens: int, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


@pytest.mark.asyncio
async def test_streams_one_client_never_reads_do_not_keep_another_clients_chat_waiting(
    demo, tmp_path: Path
):
    path = tmp_path / "events.jsonl"
    a_key, b_key = {"authorization": "Bearer sk-client-a"}, {"authorization": "Bearer sk-b"}
    async with (
        Engine.open(
            "stepline-demo", max_num_seqs=2, max_waiting=8, prefix_cache_gb=0, event_log=path
        ) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        AsyncExitStack() as streams,
    ):
        loop = engine.step_loop
        # Each step takes 20 ms at least: a's 1,500-token streams hold their slots for 30 s
        # or more, however fast this machine, while the test sends the rest.
        run = loop.runner.run
        loop.runner.run = lambda work: (time.sleep(0.02), run(work))[1]

        async def open_stream(body: dict, headers: dict) -> httpx.Response:
            r = await streams.enter_async_context(
                http.stream("POST", "/v1/chat/completions", json=body, headers=headers)
            )
            assert r.status_code == 200
            return r

        # Client a: two streams that hold both slots until it hangs up, never read ...
        held = [await open_stream(chat(f"tale {i}", 1500, stream=True), a_key) for i in range(2)]
        held_ids = [r.headers["x-request-id"] for r in held]
        await wait_until(
            loop, lambda: all(loop.state_of(r).status is Status.DECODING for r in held_ids)
        )
        # ... six more, waiting: its share of the queue (3/4 of 8) ...
        queued = [await open_stream(chat(f"story {i}", 4, stream=True), a_key) for i in range(6)]
        queued_ids = [r.headers["x-request-id"] for r in queued]
        # ... and a seventh is refused; another client still gets in.
        refused = await http.post("/v1/chat/completions", json=chat("one more", 4), headers=a_key)
        assert refused.status_code == 429
        assert refused.json()["error"]["message"].startswith("you have 6 requests waiting")

        # Another client's chat gets its answer while a's streams stay open and unread:
        # one of them steps aside (parked) until the chat is done.
        b = await open_stream(chat("Tell me about bread.", 8, stream=True), b_key)
        b_id = b.headers["x-request-id"]
        with anyio.fail_after(30):
            frames = [line async for line in b.aiter_lines() if line.startswith("data: ")]
        assert frames[-1] == "data: [DONE]"
        assert json.loads(frames[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert all(loop.state_of(r).status is Status.DECODING for r in held_ids)
        # a's parked stream takes its seat back before a's own queue starts
        await wait_until(loop, lambda: not any(loop.state_of(r).parked for r in held_ids))
        assert all(loop.state_of(r).status is Status.WAITING for r in queued_ids)

    events = list(read_events(path))
    admitted = {e.request_id: e for e in events if isinstance(e, Admitted) and e.origin == "client"}
    parked = [e.request_id for e in events if isinstance(e, Parked)]
    assert len(parked) == 1 and parked[0] in held_ids
    a_clients = {admitted[r].client for r in [*held_ids, *queued_ids]}
    assert a_clients == {client_of(Headers(a_key))}
    assert admitted[b_id].client == client_of(Headers(b_key)) != client_of(Headers(a_key))
    assert not any("sk-" in (e.client or "") for e in admitted.values())


@pytest.mark.asyncio
async def test_every_door_names_its_client_by_key_and_end_user(demo, tmp_path: Path):
    path = tmp_path / "events.jsonl"
    asks = [
        ("/v1/chat/completions", chat("hi", 1, user="alice"), {"authorization": "Bearer k1"}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "user": "bob"}, {}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "safety_identifier": "c"}, {}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "user": "d"}, {}),
        (
            "/v1/messages",
            {**chat("hi", 1), "model": "stepline-demo", "metadata": {"user_id": "erin"}},
            {"x-api-key": "k2"},
        ),
        (
            "/api/chat",
            {"model": "stepline-demo", "messages": [{"role": "user", "content": "hi"}]}
            | {"stream": False, "options": {"num_predict": 1}},
            {"authorization": "Bearer k3"},
        ),
        ("/v1/chat/completions", chat("hi", 1), {}),
    ]
    expected = [
        client_of(Headers({"authorization": "Bearer k1"}), "alice"),
        client_of(Headers({}), "bob"),
        client_of(Headers({}), "c"),
        client_of(Headers({}), "d"),
        client_of(Headers({"x-api-key": "k2"}), "erin"),
        client_of(Headers({"authorization": "Bearer k3"})),
        None,
    ]
    async with (
        Engine.open("stepline-demo", event_log=path) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        for route, body, headers in asks:
            r = await http.post(route, json=body, headers=headers)
            assert r.status_code == 200, r.text
    clients = [
        e.client for e in read_events(path) if isinstance(e, Admitted) and e.origin == "client"
    ]
    assert clients == expected
