"""Replay's why on a real run: a 2,000-token prompt arrives beside 4 decoding chats.

Runs SmolLM2 (the default model) with an event log: 4 greedy chats decode; once each has
`--warm` tokens, a prompt of ~`--prompt-tokens` tokens arrives. Then prints what
`stepline replay LOG --request` says of the prompt (what bound its chunks) and of one
decoder (what stalled it, and for how long), and the summary's stalls by cause.

    .venv/bin/python benchmarks/replay_why.py [--prompt-tokens 2000] [--keep DIR]

On the CPU backend a 2,000-token prompt takes seconds: it is the case the step-time target
and the chunked prefill exist for.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stepline.api import Engine, SamplingParams

DECODERS = 4


async def run(log: Path, prompt_tokens: int, warm: int, max_tokens: int) -> None:
    async with Engine.open(event_log=str(log)) as engine:
        tokenizer = engine.tokenizer
        filler = "The quick brown fox jumps over the lazy dog. " * (prompt_tokens // 10 + 1)
        ids = tokenizer.encode(filler)[:prompt_tokens]
        started = [asyncio.Event() for _ in range(DECODERS)]

        async def chat(i: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            n = 0
            async for _ in engine.generate(
                f"Count from 1 to 500, chat {i}:", params=params, request_id=f"decoder-{i}"
            ):
                n += 1
                if n == warm:
                    started[i].set()

        async def prompt() -> None:
            for e in started:
                await e.wait()
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(ids, params=params, request_id="long-prompt"):
                pass

        await asyncio.gather(*(chat(i) for i in range(DECODERS)), prompt())


def replay(*argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "stepline.api.cli", "replay", *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--warm", type=int, default=16, help="decoder tokens before the prompt")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens each decoder makes")
    p.add_argument("--keep", type=Path, default=None, help="write the log here and keep it")
    args = p.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="stepline-why-"))
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "run.jsonl"
    try:
        asyncio.run(run(log, args.prompt_tokens, args.warm, args.max_tokens))
        text = replay(str(log), "--request", "long-prompt")
        print("\n".join(line for line in text.splitlines()[:6]))
        text = replay(str(log), "--request", "decoder-0")
        print("\n".join(line for line in text.splitlines()[:6]))
        summary = replay(str(log)).splitlines()
        shown = [i for i, line in enumerate(summary) if line.startswith(("stalls", "step time"))]
        for i in shown:
            print(summary[i])
            print("\n".join(line for line in summary[i + 1 : i + 4] if line.startswith("  ")))
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
