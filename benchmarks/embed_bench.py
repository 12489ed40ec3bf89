"""Embeddings in the same scheduler (issue 55): throughput against mlx-lm's own batched
forward, and what an indexing job does to chat streams running beside it.

    .venv/bin/python benchmarks/embed_bench.py [--docs 256] [--words 48-384] [--batch 16]
        [--event-log PATH]

The model: SmolLM2-135M's weights (float32, as stepline serves them) laid out as a
sentence-transformers directory with last-token pooling and normalisation (Qwen3-Embedding's
recipe), built once in stepline's cache; every figure reads the same weights.

- throughput: `--docs` documents (each of `--words` words, 64-512 tokens at the defaults)
  through `Engine.embed`, all sent at once, against mlx-lm's model body run directly over
  batches of `--batch` right-padded documents (each pooled at its own last token): tokens/s.
- beside streams: 4 greedy chat streams of the same engine, their longest gap between two
  tokens alone and while the same documents are embedded; and whether every vector is the
  one it was alone (cosine).

A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = "the a model step token batch river stone light window paper garden music".split()


def embedding_dir() -> Path:
    from benchmarks.served_model import served_dir
    from stepline.engine.cache_dirs import build_once, cache_root
    from stepline.engine.demo_files import sentence_transformers_files

    source = served_dir("SmolLM2-135M-Instruct")
    target = cache_root(None) / "models" / f"{source.name}-embedding-last"

    def build(tmp: Path) -> None:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        hidden = json.loads((source / "config.json").read_text())["hidden_size"]
        for name, content in sentence_transformers_files("last", hidden).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(json.dumps(content))

    build_once(target, build)
    return target


def documents(n: int, words: tuple[int, int], seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + f" {i}" for i in range(n)
    ]


def mlx_lm_throughput(path: Path, docs: list[str], batch: int) -> tuple[float, list]:
    """mlx-lm's body over right-padded batches, each row pooled at its own last token."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from stepline.engine.forward import body_of

    model, tokenizer = load(str(path))
    body = body_of(model)
    ids = [tokenizer.encode(d) for d in docs]
    vectors: list = []
    start = time.perf_counter()
    for b in range(0, len(ids), batch):
        rows = ids[b : b + batch]
        width = max(len(r) for r in rows)
        padded = mx.array([r + [0] * (width - len(r)) for r in rows])
        hidden = body(padded)
        last = mx.array([len(r) - 1 for r in rows])
        pooled = hidden[mx.arange(len(rows)), last]
        pooled = pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)
        mx.eval(pooled)
        vectors.extend(pooled.tolist())
    seconds = time.perf_counter() - start
    return sum(len(r) for r in ids) / seconds, vectors


async def stepline_runs(path: Path, docs: list[str], event_log: str | None = None) -> dict:
    from stepline.api import Engine, SamplingParams

    out: dict = {}
    options = {"event_log": event_log} if event_log else {}
    async with Engine.open(str(path), **options) as engine:
        num_tokens = sum(len(engine.prepare(d).ids) for d in docs)

        async def embed_all() -> list:
            results = await asyncio.gather(*(engine.embed(d) for d in docs))
            return [r.embedding for r in results]

        start = time.perf_counter()
        out["alone"] = await embed_all()
        out["tok_s"] = num_tokens / (time.perf_counter() - start)

        async def streams(during) -> float:
            arrivals: list[list[float]] = [[] for _ in range(4)]
            params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
            decoding = asyncio.Event()

            async def one(i: int) -> None:
                async for o in await engine.submit(f"Story {i}: once upon a time", params=params):
                    if o.token_ids:
                        arrivals[i].append(time.perf_counter())
                    if all(len(a) >= 3 for a in arrivals):
                        decoding.set()

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await decoding.wait()
            beside = await during() if during is not None else None
            await asyncio.gather(*tasks)
            if beside is not None:
                out["beside"] = beside
            return max(b - a for times in arrivals for a, b in zip(times, times[1:], strict=False))

        out["gap_alone"] = await streams(None)
        out["gap_beside"] = await streams(embed_all)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--words", type=lambda s: tuple(map(int, s.split("-"))), default=(48, 384))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--event-log", help="write the engine's event log here (per-step timings)")
    args = p.parse_args()
    from stepline.engine import _blas  # noqa: F401 - OpenBLAS before MLX

    path = embedding_dir()
    docs = documents(args.docs, args.words)
    ours = asyncio.run(stepline_runs(path, docs, args.event_log))
    theirs, reference = mlx_lm_throughput(path, docs, args.batch)
    import numpy as np

    def cosines(a: list, b: list) -> float:
        x, y = np.array(a), np.array(b)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        y /= np.linalg.norm(y, axis=1, keepdims=True)
        return float((x * y).sum(axis=1).min())

    print(f"{args.docs} documents, {args.words[0]}-{args.words[1]} words")
    print(
        f"throughput: stepline {ours['tok_s']:.0f} tok/s, mlx-lm batched body (batch "
        f"{args.batch}) {theirs:.0f} tok/s: {ours['tok_s'] / theirs:.2f}x"
    )
    print(f"vectors against mlx-lm's: min cosine {cosines(ours['alone'], reference):.6f}")
    print(
        f"4 streams: longest gap alone {ours['gap_alone'] * 1000:.0f} ms, beside the "
        f"indexing job {ours['gap_beside'] * 1000:.0f} ms "
        f"({ours['gap_beside'] / ours['gap_alone']:.2f}x); vectors beside the streams "
        f"against alone: min cosine {cosines(ours['beside'], ours['alone']):.6f}"
    )


if __name__ == "__main__":
    main()
