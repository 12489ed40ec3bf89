"""Start-up: from spawning a server to its first answer, stepline against mlx_lm.server on
the same model directory (the float32 weights stepline serves: `served_model.py`).

    python -m benchmarks.startup --model SmolLM2-135M-Instruct --repeats 3

Two times: HTTP up (`GET /v1/models` answers 200: stepline's `/health` turns 200 only once
the engine is ready, mlx_lm.server answers while its generation thread still loads the
model), and served (a one-token chat completion answered), which is what a client waits
for. Servers start in turn, alternating, each `--repeats` times; the
first stepline start of a fresh cache also measures its warm-up (later ones reuse the kept
samples), so the first round is reported apart. Medians of the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.http_load import Spawned
from benchmarks.served_model import served_dir


async def time_to_ready(
    kind: str, model: str, log_dir: Path, peer_args: list[str]
) -> tuple[float, float]:
    t0 = time.perf_counter()
    server = Spawned(kind, model, log_dir, [], peer_args)
    try:
        await server.wait_ready(limit_s=300)
        up = time.perf_counter() - t0
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "temperature": 0.0,
        }
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
        return up, time.perf_counter() - t0
    finally:
        server.stop()


async def main_async(args) -> None:
    kinds = args.spawn.split(",")
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="stepline-startup-") as log_dir:
        served_dir(args.model)  # converted and saved once, before any timing
        for i in range(args.repeats + 1):
            for kind in kinds:
                up, served = await time_to_ready(kind, args.model, Path(log_dir), args.peer_args)
                print(
                    f"round {i}: {kind:<9} HTTP up {up:5.2f} s, served {served:5.2f} s", flush=True
                )
                times[kind].append((up, served))
    for kind in kinds:
        first, rest = times[kind][0], times[kind][1:]
        print(
            f"{kind:<9} first start: up {first[0]:5.2f} s, served {first[1]:5.2f} s; then medians: "
            f"up {statistics.median(t[0] for t in rest):5.2f} s, "
            f"served {statistics.median(t[1] for t in rest):5.2f} s"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--spawn", default="stepline,mlx_lm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peer-args", default="", help="extra arguments of the peer")
    args = p.parse_args(argv)
    args.peer_args = args.peer_args.split()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
