"""Benchmark: does a big request body stall everyone else? (issue 10, item 2)

One stream runs while N chat bodies of ~3.9 MB (under the 4 MiB limit) arrive at once; prints
the stream's longest gap between two chunks and how long the slowest big body waited for its
answer. Against a running server (`stepline serve`, or any OpenAI-compatible one):

    .venv/bin/stepline serve --port 8000 &
    .venv/bin/python benchmarks/big_bodies.py --url http://127.0.0.1:8000

Each body is sent from a thread of its own, already encoded, so the client's own work does
not delay the stream it measures.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--bodies", type=int, default=8, help="big bodies sent at once (default: 8)")
    p.add_argument("--mb", type=float, default=3.8, help="each body's text, in MB (default: 3.8)")
    p.add_argument("--stream-tokens", type=int, default=300, help="the stream's max_tokens")
    args = p.parse_args()

    sentence = "the quick brown fox hello world "
    text = sentence * int(args.mb * 1e6 / len(sentence))
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    encoded = body.encode()
    gaps: list[float] = []
    answers: list[tuple[int, float]] = []

    def stream() -> None:
        request = {
            "messages": [{"role": "user", "content": "Tell me about bread."}],
            "max_tokens": args.stream_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{args.url}/v1/chat/completions", json=request, timeout=600
        ) as r:
            last = time.monotonic()
            for _ in r.iter_raw():
                now = time.monotonic()
                gaps.append(now - last)
                last = now

    def post() -> None:
        t0 = time.monotonic()
        r = httpx.post(
            f"{args.url}/v1/chat/completions",
            content=encoded,
            headers={"content-type": "application/json"},
            timeout=600,
        )
        answers.append((r.status_code, time.monotonic() - t0))

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(0.3)  # the stream is decoding before the bodies arrive
    senders = [threading.Thread(target=post) for _ in range(args.bodies)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    streamer.join()
    statuses = sorted({status for status, _ in answers})
    print(
        f"{args.bodies} bodies of {len(encoded) / 1e6:.1f} MB: statuses {statuses}, slowest "
        f"answer {max(s for _, s in answers):.2f} s; the stream's longest gap "
        f"{max(gaps):.2f} s over {len(gaps)} chunks"
    )


if __name__ == "__main__":
    main()
