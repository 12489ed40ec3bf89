"""The server under test in benchmarks/soak.py: start and stop `stepline serve`, read its
memory (/proc, /metrics) and check its event log (`stepline replay --verify`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

try:
    from benchmarks.http_load import free_port
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from http_load import free_port  # type: ignore[no-redef]

MiB = 2**20
IN_SERVER = ("waiting", "prefilling", "decoding")  # stepline_requests_* gauges


def serve_options(model: str, server_args: list[str]) -> argparse.Namespace:
    """`stepline serve`'s own parse of the flags (its defaults, e.g. the prefix-cache budget)."""
    from stepline.api.cli.serve import add_serve_parser

    p = argparse.ArgumentParser(prog="stepline")
    add_serve_parser(p.add_subparsers())
    return p.parse_args(["serve", "--model", model, *server_args])


class Server:
    """`stepline serve` on 127.0.0.1 in a process of its own; `stop()` ends it by PID.
    Every one started is in `Server.started`, for a last `stop()` on the way out."""

    started: list[Server] = []

    def __init__(self, model: str, server_args: list[str], log_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "stepline.api.cli", "serve", "--model", model]
        cmd += [*server_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        # Its own session: a Ctrl-C reaches only this script, which then stops it in order.
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.exit_note = ""
        Server.started.append(self)

    async def wait_healthy(self, client: httpx.AsyncClient, limit_s: float = 300) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"the server exited with {self.proc.returncode}; see below\n" + self.log_tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/health")).status_code == 200:
                    return
            await asyncio.sleep(0.25)
        raise SystemExit(f"the server was not healthy after {limit_s:.0f} s\n" + self.log_tail())

    def memory(self) -> dict[str, int | None]:
        """VmRSS and VmHWM (peak RSS) of the server process, in bytes."""
        out: dict[str, int | None] = {"rss": None, "hwm": None}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss" if key == "VmRSS" else "hwm"] = int(value.split()[0]) * 1024
        return out

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"  server| {line}" for line in text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
                self.exit_note = f"exited with {self.proc.returncode} after SIGTERM"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.exit_note = "did not exit within 30 s of SIGTERM: killed"
        elif not self.exit_note:
            self.exit_note = f"had exited by itself with {self.proc.returncode}"
        self._log.close()


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """/metrics as {sample name: value} (labelled samples summed); {} if unreachable."""
    try:
        text = (await client.get(f"{base_url}/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def mlx_memory(metrics: dict[str, float]) -> dict[str, float | None]:
    """MLX active / cache / peak bytes from the server's `stepline_mlx_*` gauges, if any.
    The gauges' exact names are the server's; each part is the shortest name that holds it
    (`stepline_mlx_cache_bytes` before a `..._cache_limit_bytes`)."""
    mlx = sorted(
        (k for k in metrics if k.startswith("stepline_mlx_") and "limit" not in k), key=len
    )
    return {
        part: next((metrics[k] for k in mlx if part in k), None)
        for part in ("active", "cache", "peak")
    }


def verify_log(path: Path) -> dict[str, Any]:
    """`stepline replay LOG --verify --json`: in-flight requests and invariant violations."""
    cmd = [sys.executable, "-m", "stepline.api.cli", "replay", str(path), "--verify", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"error": f"replay exited {r.returncode}: {r.stderr.strip()[-300:]}"}
    return {
        "num_requests": report["num_requests"],
        "ok": report["ok"],
        "violations": report["counts"],
        "in_flight": len(report["in_flight"]),
        "in_flight_ids": [f["request_id"] for f in report["in_flight"]][:5],
    }


# -- readings ---------------------------------------------------------------------------------


@dataclass
class Sample:
    done: int
    elapsed_s: float
    rss: int | None
    hwm: int | None
    mlx_active: float | None
    mlx_cache: float | None
    mlx_peak: float | None
    prefix_bytes: float | None
    prefix_hits: float | None  # requests that started from a cached prefix, so far
    prefix_cached_tokens: float | None  # prompt tokens served from the cache, so far
    in_server: float | None  # requests waiting, prefilling or decoding
    num_5xx: int
    num_errors: int


def mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.0f}"


async def take_sample(
    server: Server, monitor: httpx.AsyncClient, done: int, t0: float, counts: tuple[int, int]
) -> Sample:
    """The server's memory now, from /proc and /metrics; `counts`: 5xx and errors so far."""
    metrics = await scrape(monitor, server.base_url)
    mlx = mlx_memory(metrics)
    in_server = None
    if metrics:
        in_server = sum(metrics.get(f"stepline_requests_{s}", 0.0) for s in IN_SERVER)
    return Sample(
        done=done,
        elapsed_s=time.monotonic() - t0,
        **server.memory(),
        mlx_active=mlx["active"],
        mlx_cache=mlx["cache"],
        mlx_peak=mlx["peak"],
        prefix_bytes=metrics.get("stepline_prefix_cache_bytes"),
        prefix_hits=metrics.get("stepline_prefix_cache_hits_total"),
        prefix_cached_tokens=metrics.get("stepline_prefix_cache_tokens_total"),
        in_server=in_server,
        num_5xx=counts[0],
        num_errors=counts[1],
    )


def print_sample(s: Sample, label: str | None = None) -> None:
    print(
        f"{label or s.done:>7} {s.elapsed_s:>7.1f} {mb(s.rss):>8} {mb(s.hwm):>8} "
        f"{mb(s.mlx_active):>8} {mb(s.mlx_cache):>8} {mb(s.mlx_peak):>8} "
        f"{mb(s.prefix_bytes):>8} {s.num_5xx:>5} {s.num_errors:>6}",
        flush=True,
    )


SAMPLE_HEAD = (
    f"{'done':>7} {'s':>7} {'RSS MB':>8} {'peakRSS':>8} {'mlx act':>8} {'mlx cch':>8} "
    f"{'mlx pk':>8} {'prefix':>8} {'5xx':>5} {'errors':>6}"
)


async def drain(
    server: Server, t0: float, counts: tuple[int, int], limit_s: float = 60
) -> tuple[Sample | None, int | None, int]:
    """Wait until the server runs no request (`limit_s` at most; not at all if it is
    unhealthy); returns the idle sample, how many requests the server's gauges still count
    (0 when drained; None: /metrics did not answer), and how many probe requests it sent."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as monitor:
        deadline = time.monotonic() + limit_s
        held = None
        probes = 0
        while time.monotonic() < deadline:
            m = await scrape(monitor, server.base_url)
            if not m:
                return None, held, probes
            held = int(sum(m.get(f"stepline_requests_{s}", 0.0) for s in IN_SERVER))
            if held == 0 or m.get("stepline_healthy") == 0:
                break
            # The gauges are set after a step: a request ended at an idle engine (a client
            # that hung up while it waited) stays counted until the next step. One more step:
            if probes < 3:
                with contextlib.suppress(httpx.HTTPError):
                    await monitor.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                probes += 1
            await asyncio.sleep(1)
        # Let freed memory settle, and the log writer (a thread) catch up, before reading them.
        await asyncio.sleep(3)
        return await take_sample(server, monitor, -1, t0, counts), held, probes
