"""Several models in one server (api/pool.py): served by name over real HTTP, loaded on their
first request, unloaded for memory and for idleness, never under a request; one model's
failure is that model's; one event log for them all."""

from __future__ import annotations

import argparse
import re
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from helpers import popen_serve, replay, serve_argv
from prometheus_client.parser import text_string_to_metric_families

from stepline.api import Engine, SamplingParams
from stepline.api.cli.serve import add_serve_parser, what_to_serve
from stepline.api.config import EventLogConfig, ModelSpec, PoolConfig, read_models_file
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel
from stepline.api.pool import ModelPool, ModelState
from stepline.events.log import read_events, read_runs
from stepline.events.models import ModelLoaded, ModelLoadFailed, ModelUnloaded

# Small budgets: a demo model's footprint is its ~1 MB of weights and these.
SMALL = {"max_kv_gb": 0.01, "prefix_cache_gb": 0.01, "max_step_ms": 0, "max_step_tokens": 64}
PROMPTS = ["Tell me a story", "Count to ten", "What is red?", "Name a bird"]


def spec(name: str, model: str, **fields: Any) -> ModelSpec:
    return ModelSpec.model_validate({"name": name, "model": model, **fields})


@asynccontextmanager
async def served_pool(
    *specs: ModelSpec, log: Path | None = None, **pool: Any
) -> AsyncIterator[tuple[ModelPool, str]]:
    config = PoolConfig(models=specs, **pool)
    events = EventLogConfig(event_log=str(log) if log else None)
    async with ModelPool.open(config, SMALL, events) as models:
        async with serve_in_process(create_app(models)) as url:
            yield models, url


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


async def greedy(api: openai.AsyncOpenAI, model: str, prompt: str, n: int = 12) -> str:
    stream = await api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    return "".join(parts)


async def ask(api: openai.AsyncOpenAI, model: str, prompt: str = "hi") -> str:
    """A whole (non-streamed) answer: its errors come as HTTP statuses."""
    reply = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=3
    )
    return reply.choices[0].message.content or ""


async def four_streams(api: openai.AsyncOpenAI, model: str, into: dict) -> None:
    async def one(prompt: str) -> None:
        into[(model, prompt)] = await greedy(api, model, prompt)

    async with anyio.create_task_group() as tg:
        for p in PROMPTS:
            tg.start_soon(one, p)


async def test_two_models_served_together_answer_what_each_answers_alone():
    alone: dict = {}
    for name, model in (("a", "stepline-demo"), ("b", "stepline-demo-hybrid")):
        async with Engine.open(model, **SMALL) as engine:
            async with serve_in_process(
                create_app(OneModel(engine), served_model_name=(name,))
            ) as url:
                async with client(url) as api:
                    await four_streams(api, name, alone)
    together: dict = {}
    with anyio.fail_after(120):
        async with (
            served_pool(spec("a", "stepline-demo"), spec("b", "stepline-demo-hybrid")) as (_, url),
            client(url) as api,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(four_streams, api, "a", together)
            tg.start_soon(four_streams, api, "b", together)
    assert together == alone
    assert len({v for k, v in alone.items() if k[0] == "a"}) > 1  # the prompts differ


async def test_models_are_listed_loaded_or_not_and_an_unknown_one_is_a_404_naming_them():
    with anyio.fail_after(60):
        async with served_pool(
            spec("a", "stepline-demo", aliases=("alpha",)), spec("b", "stepline-demo-hybrid")
        ) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http, client(url) as api:
                listed = (await http.get("/v1/models")).json()["data"]
                assert [(m["id"], m["loaded"]) for m in listed] == [("a", False), ("b", False)]
                assert (await http.get("/health")).json()["models"]["a"] == {"state": "unloaded"}
                assert await greedy(api, "alpha", "hi", 3)  # by its alias: loads a
                listed = (await http.get("/v1/models")).json()["data"]
                assert [(m["id"], m["loaded"]) for m in listed] == [("a", True), ("b", False)]
                assert listed[0]["max_model_len"] > 0
                tags = (await http.get("/api/tags")).json()["models"]
                assert [t["name"] for t in tags] == ["a:latest", "b:latest"]  # as Ollama names them
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": "zz", "messages": [{"role": "user", "content": "hi"}]},
                )
                assert r.status_code == 404
                assert "'a', 'alpha', 'b'" in r.json()["error"]["message"]


async def test_a_model_loading_beside_a_streaming_one_lets_its_steps_run_between_its_jobs(
    monkeypatch,
):
    """A load's MLX work (reading, proving its forwards, planning memory) is many short jobs,
    each in the loading model's turn: the streaming model's steps run between them, so its
    streams wait for one job at a time, never for the whole load. With a piece of a layer,
    each forward of a proof or of the memory plan is a step a layer (and one for its head);
    with a load's turn of 0 s, each step is a job of its own in a turn of its own."""
    from stepline.actors import turns
    from stepline.actors.executor import Executor
    from stepline.engine import forward

    monkeypatch.setattr(forward, "FORWARD_PIECE_BYTES", 1)
    monkeypatch.setattr(turns, "LOAD_TURN_S", 0)

    ran: list[Any] = []  # what the executor thread ran, in order
    call = Executor.call

    async def recorded(self, fn, *args, after=None):
        def run(*a):
            ran.append(fn)
            return fn(*a)

        return await call(self, run, *args, after=after)

    monkeypatch.setattr(Executor, "call", recorded)
    config = PoolConfig(
        models=(spec("b", "stepline-demo-hybrid", pinned=True), spec("c", "stepline-demo"))
    )
    with anyio.fail_after(120):
        async with ModelPool.open(config, SMALL) as pool:
            b = await pool.acquire("b")
            assert b.engine is not None
            steps_of_b = b.engine.step_loop.runner.run
            streaming = anyio.Event()

            async def stream() -> None:
                params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
                async for out in b.engine.generate("Tell me a story", params=params):
                    if out.num_output_tokens >= 2:
                        streaming.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                await streaming.wait()
                start = len(ran)
                pool.release(await pool.acquire("c"))  # loads c
                load = ran[start:]
                tg.cancel_scope.cancel()
            pool.release(b)
    jobs_of_c = [i for i, fn in enumerate(load) if fn is turns.steps_for_turn]
    # split head: 2 forwards, fused: 4 (the demo's steps fuse), the memory plan's: 1; of the
    # demo's 2 layers each and its head
    assert len(jobs_of_c) >= 7 * 3
    # Between c's first and last job, b stepped about as often as c ran one: turns.
    between = [fn for fn in load[jobs_of_c[0] : jobs_of_c[-1]] if fn == steps_of_b]
    assert len(between) >= len(jobs_of_c) // 2, (len(between), len(jobs_of_c))


async def test_a_model_whose_load_fails_fails_its_requests_and_the_others_serve(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with anyio.fail_after(60):
        async with (
            served_pool(spec("good", "stepline-demo"), spec("bad", missing)) as (_, url),
            client(url) as api,
        ):
            with pytest.raises(openai.APIStatusError) as err:
                await ask(api, "bad")
            assert err.value.status_code == 503
            message = err.value.body["message"]  # type: ignore[index]
            assert "'bad' could not be loaded" in message and "no-such-model" in message
            assert await greedy(api, "good", "hi", 3)
            async with httpx.AsyncClient(base_url=url) as http:
                health = (await http.get("/health")).json()
            assert health["status"] == "degraded"
            assert health["models"]["bad"]["state"] == "failed"
            assert health["models"]["good"]["state"] == "loaded"


async def test_a_budget_for_one_model_unloads_the_idle_one_and_logs_it(tmp_path):
    log = tmp_path / "run.jsonl"
    with anyio.fail_after(120):
        async with (
            served_pool(
                spec("a", "stepline-demo"),
                spec("b", "stepline-demo-hybrid"),
                log=log,
                max_memory_gb=0.03,
            ) as (models, url),
            client(url) as api,
        ):
            answers = [await greedy(api, m, "hi", 4) for m in "abab"]
            assert answers[0] == answers[2] and answers[1] == answers[3]  # same after a reload
            assert [e.state for e in models.entries.values()] == [
                ModelState.UNLOADED,
                ModelState.LOADED,
            ]
            assert models.used_bytes <= models.budget_bytes
    [run] = read_runs(log)
    assert set(run.header.models) == {"a", "b"}
    events = list(read_events(log))
    kinds = [(e.type, e.model) for e in events if isinstance(e, ModelLoaded | ModelUnloaded)]
    assert kinds[:4] == [
        ("model-loaded", "a"),
        ("model-unloaded", "a"),
        ("model-loaded", "b"),
        ("model-unloaded", "b"),
    ]
    assert {e.reason for e in events if isinstance(e, ModelUnloaded)} == {"memory", "shutdown"}
    for name in "ab":  # each model's events go on across its loads: one sequence, one step count
        mine = [e for e in events if e.model == name]
        assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
        assert [e.step for e in mine] == sorted(e.step for e in mine)
    # Replay reads the pool's log model by model.
    status, verified = replay(str(log), "--verify")
    assert status == 0 and "OK: no violations in any model" in verified
    status, summary = replay(str(log), "--model", "b")
    assert status == 0 and "requests: 2 (2 length)" in summary and "loads: 2" in summary


async def test_a_model_with_a_request_in_flight_is_never_unloaded_for_another():
    with anyio.fail_after(120):
        async with (
            served_pool(
                spec("a", "stepline-demo"), spec("b", "stepline-demo-hybrid"), max_memory_gb=0.03
            ) as (models, url),
            client(url) as api,
        ):
            long = await api.chat.completions.create(
                model="a",
                messages=[{"role": "user", "content": "go"}],
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            first = await anext(aiter(long))  # a is loaded and streaming
            result: dict[str, str] = {}

            async def ask_b() -> None:
                result["b"] = await greedy(api, "b", "hi", 3)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask_b)
                rest = [c async for c in long]
                assert "b" not in result  # b waited for a's request to end
            assert first.choices[0].delta.role == "assistant"
            assert rest[-1].choices[0].finish_reason == "length"  # never cut off
            assert result["b"]


async def test_a_model_larger_than_the_whole_budget_is_refused_with_a_400_naming_sizes():
    with anyio.fail_after(60):
        async with (
            served_pool(spec("a", "stepline-demo"), max_memory_gb=0.005) as (_, url),
            client(url) as api,
        ):
            with pytest.raises(openai.BadRequestError) as err:
                await ask(api, "a")
            assert "needs 0.02 GB" in str(err.value) and "budget of 0.00 GB" in str(err.value)


async def test_an_idle_model_past_its_time_to_live_is_unloaded(monkeypatch):
    monkeypatch.setattr("stepline.api.pool.WATCH_EVERY_S", 0.02)
    with anyio.fail_after(60):
        async with (
            served_pool(
                spec("a", "stepline-demo", ttl_s=0.05),
                spec("b", "stepline-demo-hybrid", pinned=True),
            ) as (models, url),
            client(url) as api,
        ):
            await greedy(api, "a", "hi", 3)
            a, b = models.entries["a"], models.entries["b"]
            while a.state is not ModelState.UNLOADED:
                await models._wait_for_change()
            assert b.state is ModelState.LOADED  # pinned: loaded at once, and stays


async def test_ollamas_keep_alive_is_the_model_s_time_to_live(monkeypatch):
    monkeypatch.setattr("stepline.api.pool.WATCH_EVERY_S", 0.02)
    with anyio.fail_after(60):
        async with (
            served_pool(spec("a", "stepline-demo"), model_ttl_s=600) as (models, url),
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            load = await http.post("/api/generate", json={"model": "a", "keep_alive": "1h"})
            assert load.json()["done_reason"] == "load"
            [running] = (await http.get("/api/ps")).json()["models"]
            assert running["expires_at"].startswith(f"{time.gmtime().tm_year}")  # not NEVER
            forever = {"model": "a", "keep_alive": -1}
            await http.post("/api/generate", json=forever)
            [running] = (await http.get("/api/ps")).json()["models"]
            assert running["expires_at"].startswith("2999")
            bad = await http.post("/api/generate", json={"model": "a", "keep_alive": "soon"})
            assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
            unload = await http.post("/api/generate", json={"model": "a", "keep_alive": 0})
            assert unload.json()["done_reason"] == "unload"
            a = models.entries["a"]
            while a.state is not ModelState.UNLOADED:  # once idle, as Ollama unloads it
                await models._wait_for_change()


async def test_a_models_file_s_defaults_reach_its_model_and_no_other(tmp_path):
    with anyio.fail_after(60):
        async with (
            served_pool(
                spec("a", "stepline-demo", sampling={"temperature": 0.3}, default_max_tokens=7),
                spec("b", "stepline-demo"),
            ) as (models, url),
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            for name in ("a", "b"):
                await http.post("/v1/completions", json={"model": name, "prompt": "hi"})
            cards = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
    assert cards["a"]["sampling_defaults"] == {
        "temperature": 0.3,
        "max_tokens": 7,
        "source": "models file",
    }
    assert cards["b"]["sampling_defaults"] == {"max_tokens": 4096, "source": "server"}


async def test_metrics_are_labelled_by_model():
    with anyio.fail_after(60):
        async with (
            served_pool(spec("a", "stepline-demo"), spec("b", "stepline-demo")) as (_, url),
            client(url) as api,
            httpx.AsyncClient(base_url=url) as http,
        ):
            await greedy(api, "a", "hi", 3)
            text = (await http.get("/metrics")).text
    samples = {
        (s.name, s.labels.get("model")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("stepline_model_loaded", "a")] == 1.0
    assert samples[("stepline_model_loaded", "b")] == 0.0
    assert samples[("stepline_requests_admitted_total", "a")] >= 1


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_one_model_is_served_as_before_and_several_make_a_pool(tmp_path):
    assert what_to_serve(serve_args()) is None
    assert what_to_serve(serve_args("--model", "stepline-demo")) == "stepline-demo"
    pool = what_to_serve(serve_args("--model", "a=stepline-demo", "--model", "stepline-demo"))
    assert isinstance(pool, PoolConfig)
    assert [(s.name, s.source) for s in pool.models] == [
        ("a", "stepline-demo"),
        ("stepline-demo", "stepline-demo"),
    ]
    file = tmp_path / "models.toml"
    file.write_text(
        '[models.small]\nmodel = "stepline-demo"\naliases = ["haiku"]\npinned = true\n'
        "max_step_tokens = 256\n"
    )
    pool = what_to_serve(serve_args("--models", str(file), "--max-memory-gb", "2"))
    assert isinstance(pool, PoolConfig) and pool.max_memory_gb == 2
    [small] = pool.models
    assert small.names == ("small", "haiku") and small.pinned
    assert small.engine_config({"max_num_seqs": 8}).max_step_tokens == 256


def test_a_models_file_with_a_mistake_names_it(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text('[models.small]\nmodel = "stepline-demo"\nmax_stp_tokens = 256\n')
    with pytest.raises(ValueError, match=r"\[models.small\].*unknown option 'max_stp_tokens'"):
        read_models_file(file)
    file.write_text('[models.a]\nmodel = "x"\n[models.b]\nmodel = "y"\naliases = ["a"]\n')
    with pytest.raises(ValueError, match="'a' is given to two models"):
        what_to_serve(serve_args("--models", str(file)))


async def test_a_failed_load_is_in_the_log(tmp_path):
    log = tmp_path / "run.jsonl"
    with anyio.fail_after(60):
        async with (
            served_pool(spec("bad", str(tmp_path / "nothing")), log=log) as (_, url),
            client(url) as api,
        ):
            with pytest.raises(openai.APIStatusError):
                await ask(api, "bad")
    [failed] = [e for e in read_events(log) if isinstance(e, ModelLoadFailed)]
    assert failed.model == "bad" and failed.seq == 1 and "nothing" in failed.message


@asynccontextmanager
async def gated_loads(monkeypatch) -> AsyncIterator[anyio.Event]:
    """Models load only once the yielded event is set."""
    gate = anyio.Event()
    original = Engine.open

    @asynccontextmanager
    async def gated_open(*args: Any, **kwargs: Any) -> AsyncIterator[Engine]:
        await gate.wait()
        async with original(*args, **kwargs) as engine:
            yield engine

    monkeypatch.setattr(Engine, "open", gated_open)
    yield gate


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}


async def test_a_stream_for_a_model_still_loading_gets_pings_then_its_tokens(monkeypatch):
    config = PoolConfig(models=(spec("a", "stepline-demo"), spec("b", str(Path("/no/such")))))
    with anyio.fail_after(60):
        async with (
            gated_loads(monkeypatch) as gate,
            ModelPool.open(config, SMALL) as models,
            serve_in_process(create_app(models, heartbeat_s=0.01)) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            async with http.stream(
                "POST", "/v1/chat/completions", json={"model": "a", **CHAT}
            ) as r:
                assert r.status_code == 200 and r.headers["x-request-id"]
                chunks = aiter(r.aiter_raw())
                assert (await anext(chunks)).startswith(b": ping")  # headers and pings: at once
                gate.set()
                rest = b"".join([c async for c in chunks]).replace(b": ping\n\n", b"")
            frames = [f for f in rest.split(b"\n\n") if f.strip()]
            assert frames[-1].endswith(b"data: [DONE]")
            assert b'"finish_reason":"length"' in frames[-2]
            # A model whose load fails: the stream has begun, so its error is a frame.
            async with http.stream(
                "POST", "/v1/chat/completions", json={"model": "b", **CHAT}
            ) as r:
                body = await r.aread()
            assert r.status_code == 200
            assert b"'b' could not be loaded" in body and body.endswith(b"data: [DONE]\n\n")


def test_stepline_serve_with_two_models_serves_both_and_a_sigterm_ends_it_with_0(tmp_path):
    log = tmp_path / "run.jsonl"
    argv = serve_argv(
        "--model", "a=stepline-demo", "--model", "b=stepline-demo-hybrid", "--event-log", str(log)
    )
    stderr = (tmp_path / "stderr.txt").open("w")
    proc = popen_serve(argv, stderr)
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:  # its first lines: what it serves and where
            if m := re.search(r"serving a, b at (http://127\.0\.0\.1:\d+)/v1", line):
                url = m.group(1)
                break
        assert url, "stepline serve ended before it said what it serves"
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            assert http.post("/v1/chat/completions", json={"model": "b", **body}).is_success
            models = http.get("/health").json()["models"]
        assert models == {"a": {"state": "unloaded"}, "b": {"state": "loaded"}}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        stderr.close()
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()
    unloaded = [e for e in read_events(log) if isinstance(e, ModelUnloaded)]
    assert [(e.model, e.reason) for e in unloaded] == [("b", "shutdown")]


async def test_two_models_that_cannot_both_fit_take_turns_and_every_request_is_answered(
    tmp_path, monkeypatch
):
    # Once, each model was unloaded for the other in the instant it finished loading, before
    # the request that waited for it held it: both requests hung and the loads went on.
    original = Engine.open
    opened: list[str] = []

    @asynccontextmanager
    async def counted_open(*args: Any, **kwargs: Any) -> AsyncIterator[Engine]:
        opened.append(args[0])
        async with original(*args, **kwargs) as engine:
            yield engine

    monkeypatch.setattr(Engine, "open", counted_open)
    log = tmp_path / "run.jsonl"
    rounds = 6
    with anyio.fail_after(120):
        async with (
            served_pool(
                spec("a", "stepline-demo"),
                spec("b", "stepline-demo-hybrid"),
                log=log,
                max_memory_gb=0.03,
            ) as (models, url),
            client(url) as api,
        ):
            answers: dict[tuple[int, str, int], str] = {}

            async def one(r: int, model: str, i: int) -> None:
                answers[(r, model, i)] = await greedy(api, model, PROMPTS[i], 3)

            for r in range(rounds):  # each round: both models asked for at the same moment
                before = len(opened)
                async with anyio.create_task_group() as tg:
                    for model in "ab":
                        for i in range(2):
                            tg.start_soon(one, r, model, i)
                assert len(opened) - before <= 2, opened[before:]  # turns, no thrashing
            assert len(answers) == rounds * 4 and all(answers.values())
            for model in "ab":  # the same answers whichever load served them
                assert len({answers[(r, model, 0)] for r in range(rounds)}) == 1
            # Nothing goes on loading for nobody.
            assert {e.state for e in models.entries.values()} <= {
                ModelState.LOADED,
                ModelState.UNLOADED,
            }
            assert all(e.users == 0 for e in models.entries.values())
    loads = [e for e in read_events(log) if isinstance(e, ModelLoaded)]
    assert len(loads) <= 2 * rounds  # at most one load a model a round: turns, no thrashing


async def test_a_model_that_cannot_get_room_in_time_is_a_503_and_the_pool_serves_on():
    with anyio.fail_after(120):
        async with (
            served_pool(
                spec("a", "stepline-demo"),
                spec("b", "stepline-demo-hybrid"),
                max_memory_gb=0.03,
                max_model_wait_s=0.3,
            ) as (models, url),
            client(url) as api,
        ):
            long = await api.chat.completions.create(
                model="a",
                messages=[{"role": "user", "content": "go"}],
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            await anext(aiter(long))  # a is loaded and busy: b cannot get its memory
            with pytest.raises(openai.APIStatusError) as refused:
                await ask(api, "b")
            assert refused.value.status_code == 503
            assert "could not be loaded within 0.3 s" in refused.value.message
            assert refused.value.response.headers["retry-after"]
            rest = [c async for c in long]
            assert rest[-1].choices[0].finish_reason == "length"  # a's stream never cut
            assert models.entries["b"].state is ModelState.UNLOADED  # its load gave up
            assert await ask(api, "a")
