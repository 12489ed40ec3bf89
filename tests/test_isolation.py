"""One request's trouble is that request's: cancelling at any moment is harmless, and
the prefix cache's memory is what it reports."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import anyio
import pytest
from helpers import wait_until

from stepline.api import Engine, SamplingParams
from stepline.events.log import read_events
from stepline.events.models import Admitted, Terminal


@pytest.mark.parametrize("model", ["stepline-demo", "stepline-demo-hybrid"])
async def test_cancelling_submitters_at_random_moments_leaves_the_engine_whole(
    model, model_cache_dir, tmp_path
):
    rng = random.Random(7)
    log = tmp_path / "run.jsonl"
    system = "a shared system prompt " * 12
    finished: dict[str, list[int]] = {}
    async with Engine.open(model, max_step_tokens=32, max_num_seqs=8, event_log=log) as engine:

        async def steady(i: int) -> None:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            prompt = f"{system} steady {i}"
            tokens = [t async for o in engine.generate(prompt, params=params) for t in o.token_ids]
            finished[f"steady-{i}"] = tokens

        async def doomed(i: int) -> None:
            params = SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True)
            prompt = f"{system} doomed {i} " + "word " * rng.randrange(1, 120)
            delay = rng.choice([0.0, 0.0005, 0.002, 0.01, 0.03, 0.08])
            with anyio.move_on_after(delay):
                if rng.random() < 0.5:
                    async for _ in engine.generate(prompt, params=params):
                        pass
                else:
                    stream = await engine.submit(prompt, params=params)
                    async for out in stream:
                        if out.token_ids and rng.random() < 0.3:
                            break  # leaving early, without aclose: the stream cancels itself

        loop = engine.step_loop

        def turned() -> Callable[[], bool]:
            # False when `wait_until` first asks, true when it asks again: after a turn.
            asked = iter((False,))
            return lambda: next(asked, True)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(steady, i)
            for i in range(40):
                tg.start_soon(doomed, i)
                if i % 5 == 0:  # arrivals spread over the loop's turns, cancels at random moments
                    with anyio.fail_after(10):
                        await loop.wait_until(turned())
        await wait_until(loop, lambda: not loop.states and loop.runner.num_sequences == 0)
        # /metrics says nothing runs once the engine is idle again
        scraped = engine.metrics.registry.get_sample_value
        phases = ("waiting", "prefilling", "decoding")
        assert [scraped(f"stepline_requests_{phase}") for phase in phases] == [0, 0, 0]
        assert engine.healthy
        assert len(finished) == 4 and all(len(t) == 12 for t in finished.values())
        after = await engine.submit("still serving?", params=SamplingParams(max_tokens=3))
        assert [o async for o in after][-1].finish_reason == "length"

    events = list(read_events(log))
    admitted = {e.request_id for e in events if isinstance(e, Admitted)}
    terminals = Counter(e.request_id for e in events if isinstance(e, Terminal))
    assert admitted == set(terminals) and set(terminals.values()) == {1}
    assert {e.reason for e in events if isinstance(e, Terminal)} >= {"cancelled", "length"}


async def test_the_prefix_cache_reports_the_memory_it_keeps_alive(model_cache_dir):
    import mlx.core as mx

    rng = random.Random(11)
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=8, prefix_cache_gb=1
    ) as engine:
        loop = engine.step_loop

        async def one(i: int) -> None:
            prompt = [rng.randrange(3, 900) for _ in range(rng.randrange(40, 300))]
            params = SamplingParams(max_tokens=rng.randrange(4, 30), temperature=0)
            async for _ in engine.generate(prompt, params=params, checkpoints=(20, 35)):
                pass

        # Several rounds of concurrent requests: retired batch rows and checkpoint
        # snapshots of growing caches, the two ways an entry can pin a larger buffer.
        for _ in range(3):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        # Idle: the index has heard of every entry (the last requests' retired caches come
        # back with a housekeeping result) and the executor has applied every drop it decided.
        await wait_until(loop, lambda: loop.settled and loop.runner.num_sequences == 0)
        store = loop.runner.store
        reported = loop.index.nbytes

        def active_with_and_without_entries() -> tuple[int, int, int]:
            mx.synchronize()
            stored = store.nbytes
            held = mx.get_active_memory()
            store._entries.clear()  # the only references to the entries' arrays
            mx.synchronize()
            return held, mx.get_active_memory(), stored

        held, without, stored = await loop.executor.call(active_with_and_without_entries)
    assert reported > 100_000 and stored == reported
    # What dropping the entries frees is what the cache reports (MLX's own counter).
    # The allocator rounds each buffer up to its size class, which costs these many small
    # entries 5-12% more; an entry that pinned a parent buffer cost ~30x (the old bug).
    freed = held - without
    assert 0.95 * reported <= freed <= 1.25 * reported


def test_importing_the_scheduler_the_fold_and_the_log_loads_no_mlx_nor_engine_nor_openblas():
    # every module of the scheduler package, then the fold and the log; OpenBLAS's hook
    # (stepline.engine._blas) is asked only after the check that nothing loaded the engine
    code = (
        "import importlib, pkgutil, sys\n"
        "import stepline.actors.scheduler as scheduler\n"
        "for m in pkgutil.walk_packages(scheduler.__path__, 'stepline.actors.scheduler.'):\n"
        "    importlib.import_module(m.name)\n"
        "import stepline.events.fold, stepline.events.log\n"
        "mods = sorted(m for m in sys.modules if m in ('mlx', 'stepline.engine')\n"
        "    or m.startswith(('mlx.', 'mlx_lm', 'stepline.engine.')))\n"
        "from stepline.engine import _blas\n"
        "print(mods, _blas.status()[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] None"
