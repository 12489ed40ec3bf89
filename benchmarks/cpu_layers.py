"""A hybrid model's recurrence and a mixture's experts on the CPU: stepline's against mlx-lm's,
one layer at a time, at the sizes a step gives them.

    .venv/bin/python benchmarks/cpu_layers.py [--lengths 16,79,512,2048] [--tokens 1,12,79,512]
        [--repeats 5]

- Gated DeltaNet (`engine/gated_delta.py`): a prompt of each length through one layer's
  recurrence (the Qwen3-Next-shaped demo's heads: 4 key heads, 8 value heads of 64), mlx-lm's
  per-token loop against the blocks, and the largest difference in their outputs.
- Experts (`engine/experts.py`): each number of tokens through one `SwitchGLU` of the same
  demo (8 experts of 640 -> 384, top 2), mlx-lm's gather against one product an expert.

Medians of `--repeats` timed calls after one warm-up. A measurement, not a test: run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# isort: off
import stepline.engine  # noqa: E402,F401  (OpenBLAS before MLX)
import mlx.core as mx  # noqa: E402
from mlx_lm.models import gated_delta as mlx_lm_gated_delta  # noqa: E402
from mlx_lm.models.switch_layers import SwitchGLU  # noqa: E402
from stepline.engine import experts, gated_delta  # noqa: E402
# isort: on


def timed(f: Callable[..., object], args: tuple, repeats: int) -> float:
    mx.eval(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def recurrence(lengths: list[int], repeats: int) -> None:
    print("Gated DeltaNet recurrence, one layer (ms): length, mlx-lm, blocks, ratio, max diff")
    key_heads, heads, dim = 4, 8, 64
    for length in lengths:
        mx.random.seed(0)
        q = mx.random.normal((1, length, key_heads, dim))
        k = mx.random.normal((1, length, key_heads, dim))
        q, k = mlx_lm_gated_delta.normalize_qk(q, k, inv_scale=dim**-0.5, eps=1e-6)
        v = mx.random.normal((1, length, heads, dim))
        a, b = mx.random.normal((1, length, heads)), mx.random.normal((1, length, heads))
        a_log, dt_bias = mx.random.normal((heads,)) * 0.5, mx.random.normal((heads,))
        args = (q, k, v, a, b, a_log, dt_bias, mx.zeros((1, heads, dim, dim)))
        own = timed(mlx_lm_gated_delta.gated_delta_update, args, repeats)
        ours = timed(gated_delta.update, args, repeats)
        diff = mx.abs(
            gated_delta.update(*args)[0] - mlx_lm_gated_delta.gated_delta_update(*args)[0]
        )
        print(
            f"  {length:6d}  {own:9.2f}  {ours:9.2f}  {own / ours:6.2f}x  {float(diff.max()):.1e}"
        )


def expert_layers(counts: list[int], repeats: int) -> None:
    print("Experts, one SwitchGLU (ms): tokens, mlx-lm, grouped, ratio, max diff")
    mx.random.seed(0)
    layer = SwitchGLU(640, 384, 8)
    mx.eval(layer.parameters())
    experts.install()
    for n in counts:
        x = mx.random.normal((1, n, 640))
        indices = mx.argpartition(-mx.random.normal((1, n, 8)), kth=1, axis=-1)[..., :2]
        with experts.mlx_lm_own():
            own = timed(layer, (x, indices), repeats)
            want = layer(x, indices)
        ours = timed(layer, (x, indices), repeats)
        diff = float(mx.abs(layer(x, indices) - want).max())
        print(f"  {n:6d}  {own:9.2f}  {ours:9.2f}  {own / ours:6.2f}x  {diff:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--lengths", type=ints, default=[16, 79, 512, 2048])
    p.add_argument("--tokens", type=ints, default=[1, 12, 79, 512])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    recurrence(args.lengths, args.repeats)
    expert_layers(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
