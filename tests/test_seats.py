"""Fair share while requests run (actors/scheduler/seats.py): a client that holds more than
its share of the seats while another client's request waits has its newest decoding requests
parked — out of the decode batch, their caches kept — and they resume once a seat is free.
The policy without a model (tests/core_driver.py), then the engine on real models: a parked
request's tokens are exactly the ones it makes unparked, and the log verifies."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from core_driver import make_core, params, run_step
from helpers import submit_together, wait_until

from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.api import Engine, SamplingParams
from stepline.events.fold import Status, fold
from stepline.events.log import read_events
from stepline.events.models import Parked, Resumed
from stepline.events.replay import verify
from stepline.events.replay.timeline import collect

CONFIG = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_step_ms=None)


def run_until(core, done, max_steps: int = 400) -> list:
    """Run the core's steps until `done(work)`; every step's work."""
    works = []
    for _ in range(max_steps):
        work, _ = run_step(core)
        works.append(work)
        if done(work):
            return works
    raise AssertionError("never done")


def test_a_client_over_its_share_steps_aside_for_another_clients_chat():
    core = make_core(config=CONFIG)
    for i in range(4):  # client a takes every seat with long answers
        core.add(f"a{i}", range(3), params(60), client="a")
    run_until(core, lambda w: all(core.states[f"a{i}"].status is Status.DECODING for i in range(4)))
    core.add("b0", range(5), params(3), client="b")
    work, _ = run_step(core)
    # a's newest decodes this step and is parked after it: the seats are 2 + 2 now
    assert work.plan.parks == ("a3",) and "a3" in work.plan.decodes
    assert core.states["a3"].parked and core.states["a3"].status is Status.DECODING
    work, _ = run_step(core)
    assert [c.request_id for c in work.plan.chunks] == ["b0"]  # b starts at once
    assert "a3" not in work.plan.decodes
    works = run_until(core, lambda w: "b0" not in core.states)
    assert all("a3" not in w.plan.decodes for w in works)  # parked while b runs
    # b ended: a's parked one takes its seat back, and decodes from the next step on
    work, _ = run_step(core)
    assert work.plan.resumes == ("a3",) and "a3" not in work.plan.decodes
    work, _ = run_step(core)
    assert "a3" in work.plan.decodes and not core.states["a3"].parked
    run_until(core, lambda w: not core.states)
    events = core.take_events()
    ends = {rid: s for rid, s in fold(events).items()}
    assert {rid: s.num_output_tokens for rid, s in ends.items() if rid.startswith("a")} == {
        f"a{i}": 60 for i in range(4)
    }
    assert [
        (type(e).__name__, e.request_id) for e in events if isinstance(e, Parked | Resumed)
    ] == [
        ("Parked", "a3"),
        ("Resumed", "a3"),
    ]


def test_one_client_alone_is_never_parked():
    core = make_core(config=CONFIG)
    for i in range(8):
        core.add(f"a{i}", range(3), params(20), client="a")
    works = run_until(core, lambda w: not core.states)
    assert not any(w.plan.parks or w.plan.resumes for w in works)


def test_a_parked_request_resumes_before_its_clients_new_requests_start():
    core = make_core(config=CONFIG)
    for i in range(4):
        core.add(f"a{i}", range(3), params(40), client="a")
    run_until(core, lambda w: all(core.states[f"a{i}"].status is Status.DECODING for i in range(4)))
    core.add("b0", range(5), params(2), client="b")
    core.add("a4", range(2), params(5), client="a")  # a's newer request, waiting
    run_until(core, lambda w: core.states["a3"].parked)
    works = run_until(core, lambda w: "a3" in w.plan.resumes)
    assert all(c.request_id != "a4" for w in works for c in w.plan.chunks)
    # a4 starts only once a seat is free beside a's four
    works = run_until(core, lambda w: any(c.request_id == "a4" for c in w.plan.chunks))
    assert "a3" in works[-1].plan.decodes or "a3" not in core.states


def test_a_client_is_parked_only_down_to_its_share():
    core = make_core(config=CONFIG)
    for i in range(4):
        core.add(f"a{i}", range(3), params(50), client="a")
    run_until(core, lambda w: all(core.states[f"a{i}"].status is Status.DECODING for i in range(4)))
    for i in range(4):  # b wants every seat: it is owed two (4 seats / 2 clients)
        core.add(f"b{i}", range(5), params(30), client="b")
    work, _ = run_step(core)
    assert set(work.plan.parks) == {"a2", "a3"}
    works = run_until(
        core, lambda w: sum(s.status is Status.WAITING for s in core.states.values()) == 2
    )
    running = {
        rid for rid, s in core.states.items() if s.status is not Status.WAITING and not s.parked
    }
    assert running == {"a0", "a1", "b0", "b1"}
    assert not any(w.plan.parks for w in works[1:])  # nothing more is taken from a


# -- the engine -------------------------------------------------------------------------------

A_PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=22, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=26, temperature=0.7, seed=9, logprobs=2, ignore_eos=True),
]


async def _a_tokens(name: str, *, with_b: bool, path: Path | None = None) -> dict[str, list]:
    """Client a's four requests (greedy, seeded, penalised, with logprobs) in the engine's
    four seats; with `with_b`, client b's two chats arrive once a decodes."""
    tokens: dict[str, list] = {}
    async with Engine.open(
        name, max_step_tokens=48, max_num_seqs=4, prefix_cache_gb=0, event_log=path
    ) as engine:
        loop = engine.step_loop
        streams = await submit_together(
            engine,
            [
                {"prompt": list(range(5 + 3 * i, 30 + 5 * i)), "params": p, "client": "a"}
                for i, p in enumerate(A_PARAMS)
            ],
        )

        async def read(rid: str, stream) -> None:
            got = tokens.setdefault(rid, [])
            async with stream:
                async for out in stream:
                    got.extend(
                        (t, round(lp.logprob, 4)) if out.logprobs else t
                        for t, lp in zip(
                            out.token_ids,
                            out.logprobs or [None] * len(out.token_ids),
                            strict=True,
                        )
                    )

        async with anyio.create_task_group() as tg:
            for i, s in enumerate(streams):
                tg.start_soon(read, f"a{i}", s)
            if with_b:
                await wait_until(
                    loop,
                    lambda: (
                        loop.step > 0
                        and all(s.status is Status.DECODING for s in loop.states.values())
                    ),
                )
                chat = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
                for j in range(2):
                    b = await engine.submit(list(range(40, 52 + j)), params=chat, client="b")
                    tg.start_soon(read, f"b{j}", b)
    return tokens


@pytest.mark.parametrize("name", ["demo", "demo_hybrid"])
async def test_parked_requests_make_exactly_their_tokens_and_the_log_verifies(
    request, name, tmp_path: Path
):
    loaded = request.getfixturevalue(name)
    alone = await _a_tokens(loaded.name, with_b=False)
    path = tmp_path / "events.jsonl"
    shared = await _a_tokens(loaded.name, with_b=True, path=path)
    assert {k: v for k, v in shared.items() if k.startswith("a")} == alone
    assert all(len(shared[f"b{j}"]) == 3 for j in range(2))
    events = list(read_events(path))
    parked = [e.request_id for e in events if isinstance(e, Parked)]
    resumed = [e.request_id for e in events if isinstance(e, Resumed)]
    assert parked and sorted(parked) == sorted(resumed)
    report = verify(path)
    assert report.ok, report.violations
    # the replay says why a parked stream's tokens stopped coming
    timeline = collect(path, request_ids={parked[0]}, stall_s=1e-6)
    causes = [m.cause for m in timeline.requests[parked[0]].stalls]
    assert any(c.startswith("parked after step") and "fair share" in c for c in causes)
