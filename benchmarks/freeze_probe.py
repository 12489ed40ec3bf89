"""Freeze prober: while a server works, send it one hostile body every few seconds and watch
whether everyone else is frozen — /health's latency and the longest gap of bystander streams.

    .venv/bin/python benchmarks/freeze_probe.py --url http://127.0.0.1:8000 --seconds 60
    .venv/bin/python benchmarks/soak.py --freeze-probe        # beside the soak's own load

The hostile bodies are those that can freeze a whole server: JSON nested 900
deep (in `chat_template_kwargs`, in a tool call's `arguments`, in an Anthropic body), lone
surrogates (a chat message, a background Response's `metadata`), 60,000 tools, 60,000 stop
sequences, 20,000 consecutive system messages, a Responses replay from `starting_after`
-100000000, a request with both Transfer-Encoding and Content-Length, and 1,000 idle
sockets held open for a few seconds. Each should be refused (4xx) at once.

Meanwhile a poller asks /health every 0.2 s (its worst latency is reported, target < 1 s)
and --bystanders streams of 400 tokens run one after another (their longest gap between two
chunks, target < 2 s). Exit status 0 when both targets hold and no hostile body got a 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

HEALTH_TARGET_S = 1.0
GAP_TARGET_S = 2.0
HEALTH_EVERY_S = 0.2
IDLE_SOCKETS = 1000
IDLE_HOLD_S = 3.0


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body) of every hostile POST body."""
    tool = {"type": "function", "function": {"name": "f"}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _deep(900)}}
    user = {"role": "user", "content": "x"}
    bodies: list[tuple[str, str, Any]] = [
        (
            "deep chat_template_kwargs",
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"x"}],"max_tokens":2,'
            '"chat_template_kwargs":{"enable_thinking":' + _deep(900) + "}}",
        ),
        (
            "deep tool-call arguments",
            "/v1/chat/completions",
            {
                "messages": [
                    user,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ],
                "max_tokens": 2,
            },
        ),
        (
            "deep anthropic metadata",
            "/v1/messages",
            '{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"x"}],'
            '"metadata":{"user_id":' + _deep(900) + "}}",
        ),
        (
            "lone surrogate in a chat",
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"a\\ud800"}],"max_tokens":2}',
        ),
        (
            "lone surrogate in Responses metadata",
            "/v1/responses",
            '{"input":"x","max_output_tokens":2,"background":true,"metadata":{"k":"\\ud800"}}',
        ),
        (
            "60,000 tools",
            "/v1/chat/completions",
            {"messages": [user], "tools": [tool] * 60_000},
        ),
        (
            "60,000 stop sequences",
            "/v1/messages",
            {"model": "m", "max_tokens": 2, "messages": [user], "stop_sequences": ["x"] * 60000},
        ),
        (
            "20,000 system messages",
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "s"}] * 20000 + [user], "max_tokens": 2},
        ),
    ]
    return [
        (name, path, body.encode() if isinstance(body, str) else json.dumps(body).encode())
        for name, path, body in bodies
    ]


@dataclass
class FreezeReport:
    health_max_s: float = 0.0
    health_failures: int = 0  # /health that did not answer 200
    gap_max_s: float = 0.0
    streams: int = 0
    probes: Counter[str] = field(default_factory=Counter)  # "name: status" -> count

    @property
    def probe_5xx(self) -> int:
        return sum(n for key, n in self.probes.items() if key.rsplit(": ", 1)[1].startswith("5"))

    @property
    def ok(self) -> bool:
        return (
            self.health_max_s < HEALTH_TARGET_S
            and self.gap_max_s < GAP_TARGET_S
            and self.health_failures == 0
            and self.probe_5xx == 0
        )

    def lines(self) -> list[str]:
        return [
            f"freeze probe: /health worst {self.health_max_s:.3f} s (target < "
            f"{HEALTH_TARGET_S:g} s, {self.health_failures} not 200); bystander streams' "
            f"longest gap {self.gap_max_s:.3f} s over {self.streams} streams (target < "
            f"{GAP_TARGET_S:g} s)",
            *(f"  {n:>3} x {key}" for key, n in sorted(self.probes.items())),
            "freeze probe: PASS" if self.ok else "freeze probe: FAIL",
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "health_max_s": self.health_max_s,
            "health_failures": self.health_failures,
            "gap_max_s": self.gap_max_s,
            "streams": self.streams,
            "probes": dict(self.probes),
            "probe_5xx": self.probe_5xx,
            "pass": self.ok,
        }


class FreezeProber:
    """Runs until `stop` is set: the /health poller, `bystanders` streams and a hostile
    probe every `every_s` seconds (round-robin), all against `base_url`."""

    def __init__(
        self, base_url: str, *, every_s: float = 3.0, bystanders: int = 2, model: str | None = None
    ):
        self.base_url = base_url.rstrip("/")
        self.every_s = every_s
        self.bystanders = bystanders
        self.model = model
        self.report = FreezeReport()
        self._bodies = hostile_bodies()
        self._probes: list[Callable[[httpx.AsyncClient], Any]] = [
            *(self._post_probe(name, path, body) for name, path, body in self._bodies),
            self._replay_probe,
            self._smuggling_probe,
            self._idle_sockets_probe,
        ]

    async def run(self, stop: asyncio.Event) -> FreezeReport:
        limits = httpx.Limits(max_connections=self.bystanders + 4)
        async with (
            httpx.AsyncClient(base_url=self.base_url, timeout=120, limits=limits) as client,
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(self._poll_health(stop))
            for _ in range(self.bystanders):
                tg.create_task(self._bystander(client, stop))
            tg.create_task(self._probe_loop(client, stop))
        return self.report

    async def _poll_health(self, stop: asyncio.Event) -> None:
        # A connection of its own each time: a load balancer's probe does not queue behind
        # the bystanders' streams.
        async with httpx.AsyncClient(base_url=self.base_url, timeout=30) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = (await http.get("/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.report.health_max_s = max(self.report.health_max_s, time.monotonic() - t0)
                self.report.health_failures += not ok
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), HEALTH_EVERY_S)

    async def _bystander(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": "Tell me about bread."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        if self.model:
            body["model"] = self.model
        while not stop.is_set():
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    last = time.monotonic()
                    async for _ in r.aiter_raw():
                        now = time.monotonic()
                        self.report.gap_max_s = max(self.report.gap_max_s, now - last)
                        last = now
                        if stop.is_set():
                            break
                self.report.streams += 1
            except httpx.HTTPError:
                await asyncio.sleep(0.5)

    async def _probe_loop(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            probe = self._probes[i % len(self._probes)]
            i += 1
            await probe(client)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)

    def _record(self, name: str, status: int | str) -> None:
        self.report.probes[f"{name}: {status}"] += 1

    def _post_probe(self, name: str, path: str, body: bytes) -> Callable[[httpx.AsyncClient], Any]:
        async def probe(client: httpx.AsyncClient) -> None:
            try:
                r = await client.post(
                    path, content=body, headers={"content-type": "application/json"}
                )
                self._record(name, r.status_code)
            except httpx.HTTPError as exc:
                self._record(name, type(exc).__name__)

        return probe

    async def _replay_probe(self, client: httpx.AsyncClient) -> None:
        name = "Responses replay from starting_after -100000000"
        try:
            body = {"input": "hi", "max_output_tokens": 2}
            created = await client.post("/v1/responses", json=body)
            rid = created.json().get("id")
            r = await client.get(
                f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "-100000000"}
            )
            self._record(name, r.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            self._record(name, type(exc).__name__)

    def _host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.base_url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    async def _smuggling_probe(self, client: httpx.AsyncClient) -> None:
        name = "Transfer-Encoding with Content-Length"
        body = b'{"prompt":"hi","max_tokens":1}'
        raw = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n"
        )
        try:
            reader, writer = await asyncio.open_connection(*self._host_port())
            writer.write(raw)
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 30)
            self._record(name, int(status_line.split()[1]) if status_line else "closed")
            writer.close()
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            self._record(name, type(exc).__name__)

    async def _idle_sockets_probe(self, client: httpx.AsyncClient) -> None:
        name = f"{IDLE_SOCKETS} idle sockets"
        writers = []
        try:
            for _ in range(IDLE_SOCKETS):
                writers.append((await asyncio.open_connection(*self._host_port()))[1])
            await asyncio.sleep(IDLE_HOLD_S)  # the /health poller runs meanwhile
            self._record(name, "held")
        except OSError as exc:
            self._record(name, type(exc).__name__)
        finally:
            for w in writers:
                w.close()


async def _main(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    prober = FreezeProber(args.url, every_s=args.every, bystanders=args.bystanders)
    task = asyncio.create_task(prober.run(stop))
    await asyncio.sleep(args.seconds)
    stop.set()
    report = await task
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python benchmarks/freeze_probe.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--url", required=True, help="the server (http://127.0.0.1:8000)")
    p.add_argument("--seconds", type=float, default=60, help="how long to probe (60)")
    p.add_argument("--every", type=float, default=3.0, help="seconds between probes (3)")
    p.add_argument("--bystanders", type=int, default=2, help="streams running meanwhile (2)")
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
