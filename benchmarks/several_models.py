"""Several models in one server (api/pool.py): exactness, switching and memory.

    .venv/bin/python benchmarks/several_models.py [--repeats 3] [--only exact,switch,memory]

- exact: two demo models (stepline-demo, stepline-demo-hybrid) served together over HTTP,
  4 greedy streams on each at once, against each served alone (4 streams): are the tokens
  the same, stream for stream?
- switch: (a) the first token of a request for an unloaded SmolLM2 in a running pool (another
  model loaded), against SmolLM2's cold start-up in the same process (`Engine.open`, then
  the same request's first token); (b) a loaded SmolLM2's first token for a 200-token chat
  while another model (SmolLM2 under another name) decodes 4 streams, against its first
  token with nothing else running (--system-repeat sets its length; every chat begins
  differently: no prefix-cache hits). Medians of --repeats.
- stall (not in the default run): a loaded model's 4 streams while another model loads on
  the same executor thread: their longest gap between tokens, before and during the load.
- memory: `stepline serve` with two SmolLM2 models ("a", "b") and a --max-memory-gb that
  holds one of them; 20 requests alternating a, b; every one must succeed; the process's
  peak RSS (VmHWM) against the budget.

A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOL = "SmolLM2-135M-Instruct"
CHAT = [
    {"role": "system", "content": "You are a careful assistant. " * 20},
    {"role": "user", "content": "Explain in two sentences why the sky is blue. " * 4},
]


async def exact(repeats: int) -> None:
    import anyio
    import openai

    from stepline.api import Engine
    from stepline.api.config import ModelSpec, PoolConfig
    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pipeline.served import OneModel
    from stepline.api.pool import ModelPool

    options = {"max_step_tokens": 64}
    prompts = ["Tell me a story", "Count to ten", "What is red?", "Name a bird"]
    models = {"a": "stepline-demo", "b": "stepline-demo-hybrid"}

    async def streams(url: str, name: str, into: dict) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as api:

            async def one(p: str) -> None:
                s = await api.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": p}],
                    max_tokens=64,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                into[(name, p)] = "".join([c.choices[0].delta.content or "" async for c in s])

            async with anyio.create_task_group() as tg:
                for p in prompts:
                    tg.start_soon(one, p)

    for r in range(repeats):
        alone: dict = {}
        for name, model in models.items():
            async with Engine.open(model, **options) as engine:
                app = create_app(OneModel(engine), served_model_name=(name,))
                async with serve_in_process(app) as url:
                    await streams(url, name, alone)
        together: dict = {}
        specs = tuple(ModelSpec.model_validate({"name": n, "model": m}) for n, m in models.items())
        async with ModelPool.open(PoolConfig(models=specs), options) as pool:
            async with serve_in_process(create_app(pool)) as url:
                async with anyio.create_task_group() as tg:
                    for name in models:
                        tg.start_soon(streams, url, name, together)
        same = sum(together[k] == alone[k] for k in alone)
        print(f"exact, repeat {r + 1}: {same} of {len(alone)} streams the same as alone")


async def switch(repeats: int, system_repeat: int = 20, same_chat: bool = False) -> None:
    import anyio

    from stepline.api import Engine, SamplingParams
    from stepline.api.config import ModelSpec, PoolConfig
    from stepline.api.pool import ModelPool

    params = SamplingParams(max_tokens=1, temperature=0)

    asked = 0

    async def first_token(engine: Any) -> float:
        """The first token of a chat no earlier request began with (no prefix-cache hit)."""
        nonlocal asked
        asked += 0 if same_chat else 1
        system = f"Session {asked}. " + "You are a careful assistant. " * system_repeat
        messages = [{"role": "system", "content": system}, CHAT[1]]
        t0 = time.perf_counter()
        async for out in engine.generate(messages=messages, params=params):
            if out.token_ids:
                return time.perf_counter() - t0
        raise RuntimeError("no token")

    gaps: list[float] = []  # between tokens of the other model's streams, before the request

    async def decode(engine: Any, i: int, decoding: Any) -> None:
        p = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        last = None
        async for out in engine.generate(f"Story {i}: once upon a time", params=p):
            now = time.perf_counter()
            if out.num_output_tokens >= 8:
                decoding.set()
                if i == 0 and last is not None and not measuring:
                    gaps.append(now - last)
            last = now

    measuring = False
    cold, pooled, alone, beside = [], [], [], []
    for r in range(repeats):
        # (a) cold start-up in this process, then the same request in a pool that loads it
        t0 = time.perf_counter()
        async with Engine.open(SMOL) as engine:
            await first_token(engine)
            cold.append(time.perf_counter() - t0)
        specs = (
            ModelSpec.model_validate({"name": "demo", "model": "stepline-demo", "pinned": True}),
            ModelSpec.model_validate({"name": "smol", "model": SMOL}),
        )
        async with ModelPool.open(PoolConfig(models=specs)) as pool:
            while pool.entries["demo"].engine is None:
                await pool._wait_for_change()
            t0 = time.perf_counter()
            entry = await pool.acquire("smol")
            pool.release(entry)
            await first_token(entry.engine)
            pooled.append(time.perf_counter() - t0)
        # (b) a loaded model's first token, alone and while another decodes 4 streams
        specs = (
            ModelSpec.model_validate({"name": "a", "model": SMOL, "pinned": True}),
            ModelSpec.model_validate({"name": "b", "model": SMOL, "pinned": True}),
        )
        async with ModelPool.open(PoolConfig(models=specs)) as pool:
            while any(e.engine is None for e in pool.entries.values()):
                await pool._wait_for_change()
            a, b = pool.entries["a"].engine, pool.entries["b"].engine
            for _ in range(2):  # the first request of each warms it
                await first_token(a)
                await first_token(b)
            alone.append(await first_token(a))
            decoding = anyio.Event()

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(decode, b, i, decoding)
                await decoding.wait()
                await anyio.sleep(0.5)  # all four decoding
                measuring = True
                beside.append(await first_token(a))
                measuring = False
                tg.cancel_scope.cancel()
        print(
            f"switch, repeat {r + 1}: cold start-up {cold[-1]:.2f} s, pool load + first "
            f"token {pooled[-1]:.2f} s; first token alone {alone[-1] * 1000:.0f} ms, beside "
            f"4 streams of another model {beside[-1] * 1000:.0f} ms"
        )
    med = statistics.median
    print(
        f"switch: unloaded model's first token {med(pooled):.2f} s against cold start-up "
        f"{med(cold):.2f} s ({med(pooled) - med(cold):+.2f} s; target <= +0.5 s)"
    )
    print(
        f"switch: loaded model's first token beside 4 streams of another {med(beside) * 1000:.0f}"
        f" ms against alone {med(alone) * 1000:.0f} ms: {med(beside) / med(alone):.2f}x "
        f"(target <= 1.5x); the other model's steps took {med(gaps) * 1000:.0f} ms (p50)"
    )


async def load_stall() -> None:
    """A loaded model's 4 streams while another model loads (on the same executor thread):
    their longest gap between two tokens, against their longest before the load."""
    import anyio

    from stepline.actors.executor import Executor
    from stepline.api import SamplingParams
    from stepline.api.config import ModelSpec, PoolConfig
    from stepline.api.pool import ModelPool

    # Every executor job's time, as the thread ran it: a load's longest job is the stall it
    # can cause the other model's streams, whatever else the machine does.
    jobs: list[tuple[float, float, str]] = []  # (ended at, seconds, what)
    call = Executor.call

    def what(fn, args) -> str:  # type: ignore[no-untyped-def]
        """A job's function; a turn of a load's generator (`steps_for_turn`): where it
        paused."""
        names, steps = [], args[0] if getattr(fn, "__name__", "") == "steps_for_turn" else None
        while steps is not None:
            names.append(steps.__qualname__)
            steps = getattr(steps, "gi_yieldfrom", None)
        return " > ".join(names) or getattr(fn, "__qualname__", repr(fn))

    async def timed_call(self, fn, *args, after=None):  # type: ignore[no-untyped-def]
        def run(*a):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                end = time.perf_counter()
                jobs.append((end, end - start, what(fn, a)))

        return await call(self, run, *args, after=after)

    Executor.call = timed_call  # type: ignore[method-assign]
    specs = (
        ModelSpec.model_validate({"name": "b", "model": SMOL, "pinned": True}),
        ModelSpec.model_validate({"name": "c", "model": SMOL}),
    )
    async with ModelPool.open(PoolConfig(models=specs)) as pool:
        while pool.entries["b"].engine is None:
            await pool._wait_for_change()
        b = pool.entries["b"].engine
        times: list[float] = []
        decoding = anyio.Event()

        async def decode(i: int) -> None:
            p = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
            async for out in b.generate(f"Story {i}: once upon a time", params=p):
                if i == 0:
                    times.append(time.perf_counter())
                if out.num_output_tokens >= 8:
                    decoding.set()

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(decode, i)
            await decoding.wait()
            await anyio.sleep(2)
            t0 = time.perf_counter()
            entry = await pool.acquire("c")
            pool.release(entry)
            t1 = time.perf_counter()
            await anyio.sleep(1)
            tg.cancel_scope.cancel()
    Executor.call = call  # type: ignore[method-assign]
    during = sorted((j for j in jobs if t0 <= j[0] <= t1), key=lambda j: -j[1])
    steps = [j for j in during if j[2].startswith("ModelRunner.") and "proofs" not in j[2]]
    print(
        f"the other model's steps during the load: {len(steps)}, longest "
        f"{max((j[1] for j in steps), default=0) * 1000:.0f} ms; the load's longest jobs:"
    )
    for _, seconds, what in [j for j in during if j not in steps][:8]:
        print(f"  {seconds * 1000:7.0f} ms  {what}")
    gaps_before = [b - a for a, b in zip(times, times[1:], strict=False) if b < t0]
    gaps_during = [b - a for a, b in zip(times, times[1:], strict=False) if b >= t0 and a <= t1]
    print(
        f"load stall: a second SmolLM2 loaded in {t1 - t0:.2f} s; the other model's "
        f"streams' longest gap meanwhile {max(gaps_during) * 1000:.0f} ms, before it "
        f"{max(gaps_before) * 1000:.0f} ms"
    )


def memory(budget_gb: float, requests: int) -> None:
    import httpx

    from stepline.api.http.serve import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    argv = [
        sys.executable,
        "-m",
        "stepline.api.cli",
        "serve",
        "--model",
        f"a={SMOL}",
        "--model",
        f"b={SMOL}",
        "--max-memory-gb",
        str(budget_gb),
        "--max-kv-gb",
        "0.1",
        "--prefix-cache-gb",
        "0.05",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    failures = 0
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            for _ in range(600):
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            for i in range(requests):
                model = "ab"[i % 2]
                r = http.post(
                    "/v1/chat/completions",
                    json={"model": model, "messages": CHAT, "max_tokens": 16},
                )
                failures += r.status_code != 200
            health = http.get("/health").json()
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak_kb = int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1])
    finally:
        proc.terminate()
        proc.wait(30)
    peak_gb = peak_kb / 2**20
    print(
        f"memory: {requests} alternating requests, {failures} failed; peak RSS {peak_gb:.3f} GB "
        f"against a budget of {budget_gb} GB ({(peak_gb - budget_gb) * 1024:+.0f} MB; target "
        f"<= +200 MB); models then: {health['models']}, {health['memory_gb']}"
    )


def main() -> None:
    import anyio

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="exact,switch,memory")
    parser.add_argument("--budget-gb", type=float, default=0.9)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--system-repeat",
        type=int,
        default=20,
        help="switch: the system prompt is 'You are a careful assistant. ' this many times "
        "(20: a 200-token chat)",
    )
    parser.add_argument(
        "--same-chat",
        action="store_true",
        help="switch: the same chat every time (its prefix cached after the first: a short step)",
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    os.environ.setdefault("STEPLINE_LOG_LEVEL", "warning")
    if "exact" in only:
        anyio.run(exact, args.repeats)
    if "switch" in only:
        anyio.run(switch, args.repeats, args.system_repeat, args.same_chat)
    if "stall" in only:
        anyio.run(load_stall)
    if "memory" in only:
        memory(args.budget_gb, args.requests)


if __name__ == "__main__":
    main()
