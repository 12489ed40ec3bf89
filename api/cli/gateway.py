"""`stepline gateway`: several engines behind SGLang's model gateway, on one machine.

It starts `--engines` `stepline serve` processes on 127.0.0.1 (each with its own port and,
with `--event-log-dir`, its own event log), waits until each answers `/health`, then starts
the gateway (`python -m sglang_router.launch_router`, the `gateway` extra) in front of them
with `--policy`, and health checks every `--health-interval-s` seconds: an engine that stops
answering leaves the gateway's pool after one failed check, and its new requests go to the
others. Everything after `--` is passed to every engine (`stepline serve`'s flags).

It is for trying it on one machine; across machines each engine is started by its host's
supervisor and the gateway is given their URLs (docs/gateway.md). It supervises, it does
not restart: an engine that exits is reported and the rest serve on; the gateway exiting,
the last engine exiting, SIGINT or SIGTERM stop everything (engines drain as `stepline
serve` does at a stop, for at most 30 s; a second SIGINT or SIGTERM kills them at once).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
STOP_WAIT_S = 30.0  # an engine's drain at a stop, before it is killed


def add_gateway_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `stepline gateway` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "gateway",
        help="serve several engines behind SGLang's model gateway (one machine)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--engines", type=int, default=2, help="engines to start (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    p.add_argument("--port", type=int, default=30000, help="the gateway's port (default 30000)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument(
        "--engine-ports",
        type=int,
        default=0,
        metavar="FIRST",
        help="the engines' ports: FIRST, FIRST+1, ... (default: free ports)",
    )
    p.add_argument(
        "--event-log-dir",
        type=Path,
        default=None,
        help="each engine logs to DIR/engine-N.jsonl (`stepline replay` reads them together)",
    )
    p.add_argument(
        "--health-interval-s",
        type=int,
        default=5,
        help="the gateway's health checks: an engine that fails one leaves its pool",
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=600.0,
        help="how long an engine may take to load its model",
    )
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `stepline serve` flags")
    p.set_defaults(func=run_gateway)
    return p


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (IPv4 or IPv6)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_command(port: int, log: Path | None, serve_args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "stepline.api.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    if log is not None:
        command += ["--event-log", str(log)]
    return command + serve_args


def router_command(args: argparse.Namespace, urls: list[str], metrics_port: int) -> list[str]:
    """The gateway's command line: `args.policy` over `urls`, health checks every
    `args.health_interval_s` (one failure, or no answer within half the interval, takes an
    engine out; one success brings it back), `/get_load` read as often for `power_of_two`,
    its Prometheus listener on `args.host` (the router's default is every interface) at
    `metrics_port`, and a stop that waits for its requests no longer than the engines'."""
    interval = str(args.health_interval_s)
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--worker-urls",
        *urls,
        "--policy",
        args.policy,
        "--health-check-interval-secs",
        interval,
        "--health-failure-threshold",
        "1",
        "--health-success-threshold",
        "1",
        "--health-check-timeout-secs",
        str(max(1, args.health_interval_s // 2)),  # a frozen engine answers nothing
        "--worker-startup-check-interval",
        interval,
        "--prometheus-host",
        args.host,
        "--prometheus-port",
        str(metrics_port),
        "--shutdown-grace-period-secs",
        str(int(STOP_WAIT_S)),
        "--log-level",
        "warn",
    ]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait until `url`/health answers 200; raise RuntimeError if the process exits or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine at {url} exited with status {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"the engine at {url} did not become healthy in {timeout_s:.0f} s")


def stop_all(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each (engines drain; a stopped one is continued, so that it can), then wait
    up to `STOP_WAIT_S`, then kill what is left. A SIGINT or SIGTERM meanwhile (a second
    Ctrl-C) kills them at once. From the main thread only (it sets signal handlers)."""

    def kill_now(signum: int, frame: Any) -> None:
        for p in processes:
            if p.poll() is None:
                p.kill()

    previous = {s: signal.signal(s, kill_now) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGCONT)  # a SIGSTOPped engine handles it only once woken
        deadline = time.monotonic() + STOP_WAIT_S
        for p in processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_gateway(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("sglang_router") is None:
        print(
            "stepline: error: the gateway is SGLang's router: pip install 'stepline[gateway]'",
            file=sys.stderr,
        )
        return 2
    if args.engines < 1:
        print("stepline: error: --engines must be at least 1", file=sys.stderr)
        return 2
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if args.event_log_dir is not None:
        args.event_log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[subprocess.Popen] = []
    router: subprocess.Popen | None = None

    def stop(signum: int, frame: Any) -> None:
        # Once: a second signal before `stop_all` takes over is not a second interrupt
        # (which would escape the drain and end the process with 130).
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    try:
        urls = []
        for i in range(args.engines):
            port = args.engine_ports + i if args.engine_ports else free_port()
            log = args.event_log_dir / f"engine-{i}.jsonl" if args.event_log_dir else None
            engines.append(subprocess.Popen(engine_command(port, log, serve_args)))
            urls.append(f"http://127.0.0.1:{port}")
            print(f"[gateway] engine {i}: {urls[-1]} (pid {engines[-1].pid}, log {log})")
        for url, process in zip(urls, engines, strict=True):
            wait_healthy(url, process, args.start_timeout_s)
        router = subprocess.Popen(router_command(args, urls, free_port(args.host)))
        print(
            f"[gateway] http://{args.host}:{args.port} ({args.policy}) -> {', '.join(urls)}",
            flush=True,
        )
        return supervise(router, engines, urls)
    except RuntimeError as exc:
        print(f"stepline: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all([p for p in (router, *engines) if p is not None])


def supervise(router: subprocess.Popen, engines: list[subprocess.Popen], urls: list[str]) -> int:
    """Until the gateway or the last engine exits: report each engine that exits."""
    reported: set[int] = set()
    while True:
        if router.poll() is not None:
            print(f"[gateway] the gateway exited with status {router.returncode}", flush=True)
            return 1
        for i, p in enumerate(engines):
            if p.poll() is not None and i not in reported:
                reported.add(i)
                print(
                    f"[gateway] engine {i} ({urls[i]}) exited with status {p.returncode}: "
                    "its requests go to the others",
                    flush=True,
                )
        if len(reported) == len(engines):
            print("[gateway] no engine left", flush=True)
            return 1
        time.sleep(0.5)
