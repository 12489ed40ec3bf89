"""Stopping a real `stepline serve` with SIGTERM exits 0 within 10 s (a supervisor counts
anything else as a crash) whatever it is doing: loading the model, warming up, serving streams
(several times in a row on one event log: every open stream gets its last frame and
`[DONE]`, no traceback is logged, and the log holds one clean run per start), or draining
after a first SIGTERM."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
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
STALLED_SERVE = Path(__file__).parent / "stalled_serve.py"


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
            status, took = stop(proc)
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


def stalled_argv(what: str, *options: str) -> list[str]:
    """`serve_argv(*options)` run by tests/stalled_serve.py, which stalls `what` (load,
    warmup) on the executor thread forever."""
    return [sys.executable, str(STALLED_SERVE), what, *serve_argv(*options)[3:]]


def read_until(proc: subprocess.Popen, *needles: str) -> str:
    """Read the process's stdout until each of `needles` has been in a line; return the
    server's URL."""
    assert proc.stdout is not None
    url, missing = "", set(needles)
    for line in proc.stdout:
        if m := re.search(r"(http://127\.0\.0\.1:\d+)/health answers 503", line):
            url = m.group(1)
        missing = {needle for needle in missing if needle not in line}
        if not missing:
            break
    assert not missing and url, f"stepline serve ended before it printed {sorted(missing)}"
    return url


def stop(proc: subprocess.Popen) -> tuple[int, float]:
    """SIGTERM; the exit status and the seconds it took (killed after 60 s)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    return status, time.monotonic() - t0


def test_sigterm_while_the_model_loads_exits_0_within_10_s(demo, tmp_path):
    # The load never returns: the executor thread is in it, as in a load that takes minutes.
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        proc = popen_serve(stalled_argv("load"), stderr)
    url = read_until(proc, "stalled: load")
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "loading"
    status, took = stop(proc)
    stderr = stderr_path.read_text()
    assert status == 0, stderr[-3000:]
    assert took < STOP_WITHIN_S, f"the stop took {took:.1f} s"
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]


def test_sigterm_while_warming_up_exits_0_within_10_s(demo, tmp_path):
    # A fresh cache keeps no warm-up samples, so the engine warms up while idle; its first
    # turn never returns, as a warm-up step of SmolLM2 on a busy CPU took a minute.
    log = tmp_path / "run.jsonl"
    stderr_path = tmp_path / "stderr.txt"
    argv = stalled_argv("warmup", "--model", str(demo.path), "--event-log", str(log))
    with stderr_path.open("w") as stderr:
        proc = popen_serve(argv, stderr, env={"STEPLINE_CACHE_DIR": str(tmp_path / "cache")})
    url = read_until(proc, "stalled: warmup", "serving")
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["warming_up"] is True
    status, took = stop(proc)
    stderr = stderr_path.read_text()
    assert status == 0, stderr[-3000:]
    assert took < STOP_WITHIN_S, f"the stop took {took:.1f} s"
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    assert "mlx_work_left_running" in stderr
    assert len(read_runs(log)) == 1 and verify(log).ok


def test_sigterm_again_while_draining_exits_0_within_10_s(demo, tmp_path):
    """After the first SIGTERM the server drains: open streams end at once, but a request
    whose body never arrives holds its connection until the grace period ends. A second
    SIGTERM meanwhile changes nothing: the stop ends within 10 s of the first, with 0."""
    log = tmp_path / "run.jsonl"
    stderr_path = tmp_path / "stderr.txt"
    proc, url = start_serve(log, stderr_path)
    host, port = url.removeprefix("http://").split(":")
    ends: list[bytes] = []
    try:
        started = threading.Semaphore(0)
        stream = threading.Thread(target=open_stream, args=(url, started, ends), daemon=True)
        stream.start()
        assert started.acquire(timeout=60)
        # A request whose body never comes: "100 Continue" says the server is reading it.
        upload = socket.create_connection((host, int(port)), timeout=30)
        upload.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: stepline\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        assert upload.recv(1024).startswith(b"HTTP/1.1 100 ")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stream.join(timeout=30)  # its last frame came: the server is draining
        assert ends and ends[0].endswith(b"data: [DONE]\n\n"), ends
        status, took = stop(proc)
        took = time.monotonic() - t0
        upload.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = stderr_path.read_text()
    assert status == 0, stderr[-3000:]
    assert took < STOP_WITHIN_S, f"the stop took {took:.1f} s"
    # uvicorn cancels the upload's task when the grace period ends, and logs it with its
    # traceback; nothing else fails.
    assert "timeout graceful shutdown exceeded" in stderr
    assert "terminate called" not in stderr, stderr[-3000:]
    assert len(read_runs(log)) == 1 and verify(log).ok
