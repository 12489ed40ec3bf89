"""Stopping a real `stepline serve` with SIGTERM while streams are open, several times in a
row on one event log: each stop exits 0 within 10 s (a supervisor counts anything else as a
crash), every open stream gets its last frame and `[DONE]`, no traceback is logged, and the
log holds one clean run per start."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
from helpers import popen_serve, serve_argv

from stepline.events.log import read_runs
from stepline.events.replay.verify import verify

NUM_STOPS = 3
NUM_STREAMS = 8
STOP_WITHIN_S = 10.0


def start_serve(log: Path, stderr_path: Path) -> tuple[subprocess.Popen, str]:
    argv = serve_argv(
        "--max-step-tokens", "128", "--log-format", "console", "--event-log", str(log)
    )
    with stderr_path.open("w") as stderr:
        proc = popen_serve(argv, stderr)
    assert proc.stdout is not None
    url = ""
    deadline = time.monotonic() + 90
    for line in proc.stdout:
        if m := re.search(r"(http://127\.0\.0\.1:\d+)/health answers 503", line):
            url = m.group(1)
        if "serving" in line or time.monotonic() > deadline:
            break
    assert url, "stepline serve did not start"
    return proc, url


def open_stream(url: str, started: threading.Semaphore, ends: list[bytes]) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    received = b""
    try:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{url}/v1/chat/completions", json=body) as r,
        ):
            for chunk in r.iter_raw():
                if not received:
                    started.release()
                received += chunk
    except httpx.HTTPError:
        pass
    ends.append(received[-200:])


def test_sigterm_with_open_streams_exits_0_within_10_s_every_time(demo, tmp_path):
    log = tmp_path / "run.jsonl"
    for i in range(NUM_STOPS):
        stderr_path = tmp_path / f"stderr-{i}.txt"
        proc, url = start_serve(log, stderr_path)
        ends: list[bytes] = []
        try:
            started = threading.Semaphore(0)
            threads = [
                threading.Thread(target=open_stream, args=(url, started, ends), daemon=True)
                for _ in range(NUM_STREAMS)
            ]
            for t in threads:
                t.start()
            for _ in threads:  # every stream has its first frame
                assert started.acquire(timeout=60)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=60)
            took = time.monotonic() - t0
            for t in threads:
                t.join(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        stderr = stderr_path.read_text()
        assert status == 0, stderr[-3000:]
        assert took < STOP_WITHIN_S, f"stop {i} took {took:.1f} s"
        assert len(ends) == NUM_STREAMS
        assert all(end.endswith(b"data: [DONE]\n\n") for end in ends), ends
        assert all(b"shutting down" in end for end in ends), ends
        assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    assert len(read_runs(log)) == NUM_STOPS
    assert verify(log).ok
