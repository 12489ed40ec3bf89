"""Two stepline engines behind SGLang's model gateway (`sglang-router`, the real Rust router),
started as a user starts them: `stepline gateway --engines 2 ... -- --model stepline-demo`.

One gateway serves the module: the worker endpoints the router reads (`/get_load`,
`/server_info`), requests through its `power_of_two` policy (which reads `/get_load`), each
engine's own event log, and an engine killed mid-stream: its streams end with an error the
client sees, and every later request succeeds on the other engine.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from helpers import until

from stepline.api.cli.gateway import add_gateway_parser, free_port, router_command, stop_all
from stepline.events.log import read_events
from stepline.events.models import Admitted

HEALTH_INTERVAL_S = 1


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    engines: list[tuple[int, str]]  # (pid, url) of each engine
    logs: Path
    lines: list[str]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def gateway(demo, tmp_path_factory) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("gateway")
    port = free_port()
    stderr = (logs / "stderr.txt").open("w")  # the engines' access logs among it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepline.api.cli",
            "gateway",
            "--engines",
            "2",
            "--port",
            str(port),
            "--policy",
            "power_of_two",
            "--health-interval-s",
            str(HEALTH_INTERVAL_S),
            "--event-log-dir",
            str(logs),
            "--",
            "--model",
            "stepline-demo",
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:

        def started() -> bool:
            assert proc.poll() is None, f"stepline gateway exited: {lines}"
            return any("power_of_two" in line for line in lines)

        until(started, within=180, what=f"the gateway's start: {lines}")
        engines = [
            (int(m[2]), m[1])
            for line in lines
            if (m := re.search(r"engine \d+: (http://\S+) \(pid (\d+)", line))
        ]

        def lists_the_model() -> bool:  # the router registers the engines in the background
            try:
                r = httpx.get(f"{url}/v1/models", timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and bool(r.json()["data"])

        until(lists_the_model, within=180, what="the gateway listing the model")
        yield Gateway(proc, url, engines, logs, lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            stderr.close()


def reads(gateway: Gateway, route: str) -> int:
    """How many times the engines' access logs show the gateway reading `route`."""
    return (gateway.logs / "stderr.txt").read_text().count(f'"GET {route} HTTP/1.1" 200')


def read_again(gateway: Gateway, route: str, times: int = 1) -> None:
    """Until the gateway has read `route` of the live engines `times` more rounds (once a
    health interval: each round reads every engine)."""
    seen, num_live = reads(gateway, route), 2 - sum(1 for line in gateway.lines if "exited" in line)
    until(
        lambda: reads(gateway, route) >= seen + times * max(num_live, 1),
        within=10 * HEALTH_INTERVAL_S * times,
        what=f"the gateway reading {route} again",
    )


def _chats_succeed(client: openai.OpenAI, n: int, what: str) -> None:
    """`n` short chats, one after another, each answered in full."""
    for i in range(n):
        out = client.chat.completions.create(
            model="stepline-demo",
            messages=[{"role": "user", "content": f"{what} {i}"}],
            max_tokens=4,
        )
        assert out.choices[0].finish_reason in ("length", "stop")


def test_the_engines_answer_what_the_gateway_reads(gateway: Gateway):
    assert len(gateway.engines) == 2
    listed = httpx.get(f"{gateway.url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["stepline-demo"]  # from the engines' /server_info
    for _, url in gateway.engines:
        info = httpx.get(f"{url}/server_info").json()
        assert info["served_model_name"] == "stepline-demo"
        assert (info["tp_size"], info["dp_size"]) == (1, 1)
        assert info["context_length"] > 0 and "model_path" not in info
        assert httpx.get(f"{url}/get_model_info").json()["served_model_name"] == "stepline-demo"
        load = httpx.get(f"{url}/get_load").json()
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_get_load_counts_the_tokens_of_the_requests_in_flight(gateway: Gateway):
    _, url = gateway.engines[0]
    seen: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.extend(httpx.get(f"{url}/get_load").json())

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="stepline-demo",
            prompt="count " * 50,
            max_tokens=200,
            extra_body={"ignore_eos": True},
        )
    finally:
        stop.set()
        poller.join()
    busy = [s for s in seen if s["num_reqs"] == 1]
    assert busy, "never saw the request in flight"
    prompt = out.usage.prompt_tokens
    assert all(prompt <= s["num_tokens"] <= prompt + 200 for s in busy)


def test_requests_through_power_of_two_succeed_and_each_engine_logs_its_own(gateway: Gateway):
    _chats_succeed(gateway.client(), 8, "question")
    admitted = {
        log.name: sum(isinstance(e, Admitted) for e in read_events(log))
        for log in sorted(gateway.logs.glob("engine-*.jsonl"))
    }
    assert list(admitted) == ["engine-0.jsonl", "engine-1.jsonl"]
    # power_of_two weighs the engines by their /get_load, which the gateway reads (every
    # health interval)
    until(
        lambda: reads(gateway, "/get_load") > 0,
        within=10 * HEALTH_INTERVAL_S,
        what="the gateway reading /get_load",
    )
    assert sum(admitted.values()) >= 8


def test_a_response_made_through_the_gateway_is_retrieved_through_it(gateway: Gateway):
    # The gateway re-sends the body in its own types ("stream": null among them), and asks
    # every engine for a stored response: the one that made it answers.
    client = gateway.client()
    made = client.responses.create(model="stepline-demo", input="hello", max_output_tokens=4)
    assert made.status in ("completed", "incomplete")
    got = client.responses.retrieve(made.id)
    assert (got.id, got.output_text) == (made.id, made.output_text)


def test_an_engine_killed_mid_stream_fails_its_streams_and_the_other_serves_on(
    gateway: Gateway,
):
    client = gateway.client()
    outcomes: dict[int, str] = {}

    def stream(i: int) -> None:
        try:
            finish = None
            for chunk in client.completions.create(
                model="stepline-demo",
                prompt=f"story {i} " * 20,
                max_tokens=3000,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                finish = chunk.choices[0].finish_reason or finish
            outcomes[i] = f"finished: {finish}" if finish else "ended without a finish reason"
        except (openai.APIError, httpx.HTTPError) as exc:
            outcomes[i] = f"error: {type(exc).__name__}"

    # Streams one at a time until one is on engine 1 (power_of_two sends the next to the
    # engine whose /get_load, read every second, is lighter).
    victim_pid, victim_url = gateway.engines[1]
    threads: list[threading.Thread] = []
    while httpx.get(f"{victim_url}/get_load").json()[0]["num_reqs"] == 0:
        assert len(threads) < 8, "no stream reached engine 1"
        threads.append(threading.Thread(target=stream, args=(len(threads),)))
        threads[-1].start()
        read_again(gateway, "/get_load")  # the next stream goes by the load with this one
    os.kill(victim_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    # the killed engine's stream ends in an error the client sees; none hangs
    assert len(outcomes) == len(threads)
    assert any(o.startswith("error") for o in outcomes.values()), outcomes
    # the gateway reports it, and after its next health checks every new request succeeds
    until(
        lambda: any("engine 1" in line and "exited" in line for line in gateway.lines),
        within=10,
        what="the gateway reporting engine 1's exit",
    )
    read_again(gateway, "/health", times=2)
    _chats_succeed(client, 6, "after")


# -- the gateway process itself (no engine started) -------------------------------------------


def _gateway_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_parser(parser.add_subparsers())
    args = parser.parse_args(["gateway"])
    return argparse.Namespace(**{**vars(args), **overrides})


def test_every_listener_of_the_router_is_on_the_host_asked_for():
    command = router_command(_gateway_args(host="127.0.0.1"), ["http://127.0.0.1:1"], 4242)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--prometheus-host") + 1] == "127.0.0.1"  # not 0.0.0.0
    assert command[command.index("--prometheus-port") + 1] == "4242"
    # a frozen engine is out after at most one interval and half of one
    assert int(command[command.index("--health-check-timeout-secs") + 1]) <= 2


def _sleeper(*setup: str) -> subprocess.Popen:
    code = "; ".join(["import signal, time", *setup, "print('up', flush=True)", "time.sleep(60)"])
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    with p.stdout:
        assert p.stdout.readline() == "up\n"
    return p


def test_a_stop_ends_an_engine_that_is_stopped_at_once():
    frozen = _sleeper()
    os.kill(frozen.pid, signal.SIGSTOP)
    started = time.monotonic()
    stop_all([frozen])
    assert time.monotonic() - started < 5  # not STOP_WAIT_S: it was woken to take the SIGTERM
    assert frozen.returncode == -signal.SIGTERM


def test_a_second_signal_during_the_drain_kills_what_is_left_and_returns():
    stubborn = _sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)")  # drains forever
    previous = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    try:
        stop_all([stubborn])
    finally:
        timer.cancel()
    assert time.monotonic() - started < 5
    assert stubborn.returncode == -signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) is previous  # the caller's handler is back
