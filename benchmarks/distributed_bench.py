"""Benchmark: one process vs a 2-rank tensor-parallel job over loopback (ring backend).

    .venv/bin/python benchmarks/distributed_bench.py [--model stepline-demo-large]
        [--requests 4] [--prompt-tokens 256] [--max-tokens 64] [--json OUT.json]

Each configuration runs in fresh processes on 127.0.0.1 (the 2-rank job is started the way
`mlx.launch --backend ring -n 2` starts it), through the Python API with the same
requests: `--requests` prompts of `--prompt-tokens` tokens submitted at once, greedy,
`--max-tokens` each. Reported per configuration:
- TTFT: mean time from submitting to the first token;
- decode tokens/s: tokens after each request's first, over the time from the last first
  token to the last token (every request decoding);
- per step: mean step time, and for 2 ranks the time rank 0 spends broadcasting the step
  (`DistributedRunner.comm_seconds`) and a measured all_sum of one decode batch's hidden
  states (batch x hidden, the collective mlx-lm's sharded layers run twice per layer),
  times 2 x layers: the communication inside the forward.

On one machine the two ranks share its cores and talk through loopback, so no speed-up is
expected: this measures the overhead a step pays for being distributed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio


def _prompt(n: int, salt: int) -> list[int]:
    return [3 + (i * 31 + salt * 7) % 900 for i in range(n)]


async def _measure(model: str, parallel: str | None, args: argparse.Namespace) -> dict:
    from stepline.api import Engine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    async with Engine.open(
        model, parallel=parallel, max_step_tokens=args.step_tokens, prefix_cache_gb=0
    ) as engine:
        warm = await engine.submit(_prompt(32, 99), params=SamplingParams(max_tokens=4))
        async for _ in warm:
            pass
        runner = engine.step_loop.runner
        comm0, calls0 = getattr(runner, "comm_seconds", 0.0), getattr(runner, "num_calls", 0)
        step0 = engine.step_loop.step
        firsts: list[float] = []
        lasts: list[float] = []
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            stream = await engine.submit(_prompt(args.prompt_tokens, i), params=params)
            first = None
            async for out in stream:
                if out.token_ids and first is None:
                    first = time.perf_counter()
            assert first is not None
            firsts.append(first)
            lasts.append(time.perf_counter())

        async with anyio.create_task_group() as tg:
            for i in range(args.requests):
                tg.start_soon(one, i)
        t1 = time.perf_counter()
        steps = engine.step_loop.step - step0
        result = {
            "ttft_ms": statistics.mean(f - t0 for f in firsts) * 1000,
            "decode_tokens_per_s": args.requests
            * (args.max_tokens - 1)
            / max(max(lasts) - max(firsts), 1e-9),
            "steps": steps,
            "step_ms": (t1 - t0) / steps * 1000,
        }
        if parallel is not None:
            calls = runner.num_calls - calls0
            result["broadcast_ms_per_call"] = (runner.comm_seconds - comm0) / calls * 1000
            result["forward_allsum_ms_per_step"] = args.allsum_ms
    return result


def _allsum_ms(model: str, batch: int) -> float:
    """Time of the all_sums in one decode forward: 2 per layer of (batch, 1, hidden).

    Run on every rank before the engine starts (the ranks' collectives must match)."""
    import mlx.core as mx

    from stepline.engine.models import demo_model_path

    config = json.loads((demo_model_path(model) / "config.json").read_text())
    x = mx.ones((batch, 1, config["hidden_size"]), dtype=mx.float32)
    for _ in range(3):
        mx.eval(mx.distributed.all_sum(x))
    n = 50
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(mx.distributed.all_sum(x))
    per = (time.perf_counter() - t) / n
    return per * 2 * config["num_hidden_layers"] * 1000


def _worker(args: argparse.Namespace) -> None:
    import stepline.engine  # noqa: F401 - OpenBLAS before MLX

    parallel = None if args.worker == "1" else "tensor"
    args.allsum_ms = _allsum_ms(args.model, args.requests) if parallel else None
    result = anyio.run(_measure, args.model, parallel, args)
    if result is not None:  # rank 0 (other ranks end inside Engine.open)
        Path(args.out).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ranks: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"r{ranks}.json"
    argv = [sys.executable, __file__, "--worker", str(ranks), "--out", str(out)]
    for flag in ("model", "requests", "prompt_tokens", "max_tokens", "step_tokens"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(ranks)]))
    procs = []
    try:
        for rank in range(ranks):
            env = dict(os.environ)
            if ranks > 1:
                env |= {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="stepline-demo-large")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--step-tokens", type=int, default=512)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        results = {f"{n} rank{'s' * (n > 1)}": _run(n, args, Path(tmp)) for n in (1, 2)}
    print(
        f"{args.model}: {args.requests} request(s) x {args.prompt_tokens} prompt tokens, "
        f"{args.max_tokens} output tokens each, greedy"
    )
    for name, r in results.items():
        line = (
            f"  {name:8s} TTFT {r['ttft_ms']:8.1f} ms   decode {r['decode_tokens_per_s']:7.1f} "
            f"tokens/s   step {r['step_ms']:6.1f} ms"
        )
        if "broadcast_ms_per_call" in r:
            line += (
                f"   broadcast {r['broadcast_ms_per_call']:.2f} ms/call   "
                f"all_sums in forward {r['forward_allsum_ms_per_step']:.2f} ms/step"
            )
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
