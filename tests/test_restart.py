"""Restarting `stepline serve --event-log run.jsonl` after a kill -9, with the same command line:
a real server process (the demo model, 127.0.0.1), killed mid-stream, started again, and the
combined log replayed and verified."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import until

from stepline.api.cli.replay import add_replay_parser
from stepline.events.log import read_runs

STARTUP_S = 90  # loading MLX and the demo model on a busy machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(command: list[str], log_file: Path) -> subprocess.Popen:
    out = open(log_file, "ab")  # noqa: SIM115 - the child owns it for its life
    try:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def _wait_healthy(proc: subprocess.Popen, url: str, output: Path) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{output.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(healthy, within=STARTUP_S, every=0.2, what="serve healthy")
    except AssertionError as exc:
        pytest.fail(f"{exc}:\n{output.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _replay(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="stepline")
    add_replay_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_serve_restarts_after_kill_9_with_the_same_command_and_the_log_verifies(
    tmp_path: Path, demo
) -> None:
    log = tmp_path / "run.jsonl"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    stepline = str(Path(sys.executable).with_name("stepline"))
    command = [stepline, "serve", "--model", "stepline-demo", "--event-log", str(log)]
    command += ["--port", str(port)]
    command += ["--max-step-tokens", "64", "--max-num-seqs", "4"]
    output = tmp_path / "serve.out"
    assert os.environ.get("STEPLINE_CACHE_DIR")  # the child finds the demo model built

    first = _serve(command, output)
    try:
        _wait_healthy(first, url, output)
        body = {
            "model": "stepline-demo",
            "prompt": "count with me " * 8,
            "max_tokens": 1500,  # far more than it gets to stream before the kill
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                interrupted_id = None
                frames = 0
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        interrupted_id = interrupted_id or json.loads(line[6:])["id"]
                        frames += 1
                    if frames >= 5:
                        first.send_signal(signal.SIGKILL)  # mid-stream, no chance to clean up
                        break
        first.wait(timeout=30)
    finally:
        _stop(first, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL

    second = _serve(command, output)  # the very same command line
    try:
        _wait_healthy(second, url, output)
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "stepline-demo", "prompt": "after the restart", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200
        finished_id = reply.json()["id"]
    finally:
        _stop(second, signal.SIGTERM)
    assert second.returncode == 0, output.read_text()[-3000:]

    runs = read_runs(log)
    assert len(runs) == 2 and runs[0].header.run_id != runs[1].header.run_id
    assert runs[0].header.salt != runs[1].header.salt
    code, text = _replay(str(log), "--verify", "--json")
    report = json.loads(text)
    assert code == 0, text
    assert report["ok"] and len(report["runs"]) == 2
    assert [(r["run"], r["request_id"]) for r in report["interrupted"]] == [(1, interrupted_id)]
    assert report["in_flight"] == []
    code, text = _replay(str(log), "--request", finished_id)
    assert code == 0 and "length" in text
    code, text = _replay(str(log))
    assert code == 0 and "interrupted (1;" in text and "2 runs" in text
