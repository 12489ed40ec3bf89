"""Memory and queue limits that hold: the KV guard, the bounded waiting queue, MLX's own
memory counters and its buffer cache limit."""

from __future__ import annotations

import anyio
import pytest
from helpers import collect, wait_until

from stepline.api import Engine, KVBudgetExceededError, QueueFullError, SamplingParams
from stepline.engine.memory import (
    KVFootprint,
    default_kv_budget_bytes,
    kv_tokens_for_budget,
    machine_memory_bytes,
    measure_kv_footprint,
    weights_bytes,
)
from stepline.events.fold import Status

import mlx.core as mx  # isort: skip  # after stepline.engine, which loads OpenBLAS first


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 37 + salt * 11) % 250 for i in range(n)]


# -- measuring the KV footprint --------------------------------------------------------------


def test_kv_bytes_per_token_is_what_the_attention_layers_store(demo):
    args = demo.model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    itemsize = demo.model.model.embed_tokens.weight.dtype.size
    expected = args.num_hidden_layers * 2 * args.num_key_value_heads * head_dim * itemsize
    # mlx-lm's KVCache grows its buffer 256 slots at a time
    assert measure_kv_footprint(demo.model) == KVFootprint(
        bytes_per_token=expected, bytes_per_seq=0, growth_tokens=255
    )


def test_recurrent_state_counts_once_per_request_not_per_token(demo_hybrid):
    footprint = measure_kv_footprint(demo_hybrid.model)
    assert footprint.bytes_per_token > 0 and footprint.bytes_per_seq > 0
    assert footprint.tokens_per_seq() * footprint.bytes_per_token >= footprint.bytes_per_seq


def test_a_budget_in_bytes_becomes_tokens():
    footprint = KVFootprint(bytes_per_token=512, bytes_per_seq=1000)
    assert kv_tokens_for_budget(2**30, footprint) == 2**21
    assert kv_tokens_for_budget(10, footprint) == 1  # never zero: the guard then refuses clearly
    assert footprint.tokens_per_seq() == 2  # 1000 bytes of state = 2 tokens' worth, rounded up
    grows = KVFootprint(bytes_per_token=512, bytes_per_seq=1000, growth_tokens=255)
    assert grows.tokens_per_seq() == 2 + 255  # and the room its buffer may have grown by


def test_the_default_budget_leaves_room_for_weights_and_prefix_cache():
    gb = 2**30
    assert default_kv_budget_bytes(16 * gb, 2 * gb, 1 * gb) == int(16 * gb * 0.7) - 3 * gb
    assert default_kv_budget_bytes(16 * gb, 20 * gb, 0) == int(16 * gb * 0.1)  # never below 10%


# -- the KV guard --------------------------------------------------------------------------


async def test_a_tiny_kv_budget_makes_requests_wait_and_refuses_one_that_never_fits(
    model_cache_dir, demo
):
    footprint = measure_kv_footprint(demo.model)
    per_token, per_seq = footprint.bytes_per_token, footprint.tokens_per_seq()
    budget_tokens = 2 * (80 + per_seq) + 10  # two requests of 20 + 60 tokens, not three
    running_kv: list[int] = []
    held_kv: list[int] = []
    async with Engine.open(
        "stepline-demo",
        max_step_tokens=64,
        max_num_seqs=8,
        prefix_cache_gb=0,
        max_kv_gb=budget_tokens * per_token / 2**30,
    ) as engine:
        assert engine.config["max_kv_tokens"] == budget_tokens
        loop = engine.step_loop

        def on_step(loop) -> None:
            running = [s for s in loop.states.values() if s.status is not Status.WAITING]
            running_kv.append(sum(s.num_prompt_tokens + s.params.max_tokens for s in running))

        loop.on_step = on_step
        runner = loop.runner
        run = runner.run

        def run_and_weigh(work):  # on the executor thread, right after each step
            result = run(work)
            caches = [*runner.batch.caches.groups, *(q.cache or [] for q in runner._seqs.values())]
            mx.eval([layer.state for cache in caches for layer in cache])
            held_kv.append(sum(layer.nbytes for cache in caches for layer in cache))
            return result

        runner.run = run_and_weigh
        p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        streams = [await engine.submit(prompt_of(20, i), params=p) for i in range(4)]
        with anyio.fail_after(60):
            finals = [(await collect(s))[-1].finish_reason for s in streams]
        assert finals == ["length"] * 4  # every one served, none refused
        assert any(n == 160 for n in running_kv)  # 2 ran at a time; 2 waited
        assert max(running_kv) <= 160
        # The KV buffers they really held (grown 256 slots at a time, 4x their 80 tokens'
        # worth at first) stayed within the budget.
        assert 0 < max(held_kv) <= budget_tokens * per_token

        with pytest.raises(KVBudgetExceededError) as err:
            await engine.submit(prompt_of(20), params=p.model_copy(update={"max_tokens": 800}))
        message = str(err.value)
        assert f"{820 + per_seq} tokens" in message and f"{budget_tokens} tokens" in message
        assert "room its KV buffer grows by" in message
        assert "GB" in message and "max_tokens" in message
        assert engine.healthy


async def test_max_kv_tokens_and_max_kv_gb_are_one_or_the_other(model_cache_dir):
    with pytest.raises(ValueError, match="not both"):
        async with Engine.open("stepline-demo", max_kv_tokens=100, max_kv_gb=1.0):
            pass


async def test_without_a_budget_the_kv_guard_takes_a_fraction_of_the_machine(model_cache_dir):
    async with Engine.open("stepline-demo", prefix_cache_gb=0.5) as engine:
        model = engine.loaded.model
        expected = kv_tokens_for_budget(
            default_kv_budget_bytes(machine_memory_bytes(), weights_bytes(model), 2**29),
            measure_kv_footprint(model),
        )
        assert engine.config["max_kv_tokens"] == expected


# -- the waiting queue ----------------------------------------------------------------------


async def test_a_full_waiting_queue_refuses_new_requests_until_it_drains(model_cache_dir):
    async with Engine.open(
        "stepline-demo", max_step_tokens=16, max_num_seqs=1, max_waiting=2
    ) as engine:
        loop = engine.step_loop
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        first = await engine.submit("the one running", params=long)
        rid = first.request_id
        await wait_until(loop, lambda: loop.state_of(rid).status is Status.DECODING)
        waiting = [await engine.submit(f"waiting {i}", params=long) for i in range(2)]
        with pytest.raises(QueueFullError, match="2 of 2 requests waiting") as err:
            await engine.submit("one too many", params=long)
        assert err.value.retry_after_s > 0
        assert engine.healthy
        with anyio.fail_after(60):
            for s in [first, *waiting]:
                assert (await collect(s))[-1].finish_reason == "length"
        outs = await collect(await engine.submit("room again", params=long))
        assert outs[-1].finish_reason == "length"


# -- MLX's own memory -----------------------------------------------------------------------


async def test_mlx_memory_is_exported_and_its_buffer_cache_is_limited(model_cache_dir):
    async with Engine.open("stepline-demo", mlx_cache_gb=0.25) as engine:
        outs = await collect(
            await engine.submit("hello", params=SamplingParams(max_tokens=8, ignore_eos=True))
        )
        assert outs[-1].finish_reason == "length"
        samples = {s.name: s.value for m in engine.metrics.registry.collect() for s in m.samples}
        limit = await engine._executor.call(mx.set_cache_limit, 2**28)  # read it back, same value
    assert limit == 2**28
    assert samples["stepline_mlx_active_bytes"] > 0
    assert samples["stepline_mlx_peak_bytes"] >= samples["stepline_mlx_active_bytes"]
    assert 0 <= samples["stepline_mlx_cache_bytes"] <= 2**28


def test_the_cli_refuses_a_request_past_its_kv_budget_naming_the_numbers(model_cache_dir, capsys):
    from stepline.api.cli import main

    code = main(
        [
            "generate",
            "hi",
            "--model",
            "stepline-demo",
            "--max-tokens",
            "64",
            "--max-kv-tokens",
            "10",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "stepline: error:" in err and "(10 tokens" in err and "max_tokens (64)" in err


async def test_a_chat_without_max_tokens_runs_to_the_kv_budget_not_into_a_refusal(
    model_cache_dir,
):
    import httpx

    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pipeline.served import OneModel

    # The demo's context is 2,048 tokens; the budget holds 200 beside the room a request's
    # KV buffer grows by: "to the end of the context" can never fit, "to the end of the
    # budget" can.
    per_seq = 255  # mlx-lm's KVCache grows 256 slots at a time
    async with Engine.open(
        "stepline-demo", max_kv_tokens=200 + per_seq, max_step_ms=None
    ) as engine:
        assert engine.step_loop.config.kv_tokens_per_seq == per_seq
        async with serve_in_process(create_app(OneModel(engine))) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "stepline-demo",
                        "messages": [{"role": "user", "content": "hi"}],
                        "ignore_eos": True,
                    },
                )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 200
