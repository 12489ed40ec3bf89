"""Soak: many mixed requests against `stepline serve`, watching memory, 5xx and lost requests.

    .venv/bin/python benchmarks/soak.py                          # 1,000 requests, 64 at a time
    .venv/bin/python benchmarks/soak.py --requests 300 --concurrency 32 \
        --server-arg=--prefix-cache-gb=0                         # the prefix cache off

It starts `stepline serve` on 127.0.0.1 (a free port; the demo model unless --model; every
--server-arg passed through), waits for /health, then sends --requests requests,
--concurrency at a time, from a seeded mix: chat and completions, streamed and not, prompts
from a few tokens to ~1,500 (cut to the model's context), half the chats under one of a few
shared system prompts (the prefix cache's work); --disconnect-frac of the clients hang up at
a random point (mid-stream, or mid-wait for a non-streamed answer).

Every 100 requests it prints the server's RSS (/proc/PID/status), MLX active / cache / peak
memory (the `stepline_mlx_*_bytes` gauges of /metrics, "n/a" where the server has none), the prefix
cache's reported bytes, 5xx and errors. At the end, once the server has drained: RSS growth
(idle, after the load, minus idle after one warm-up request) against the prefix-cache budget
+ 100 MiB, 5xx (HTTP statuses and in-stream error frames), unterminated requests (seen by the
clients: a stream that never gave a finish_reason or an error frame, no answer within
--request-timeout; and in the event log: requests with no terminal event, per `stepline replay
LOG --verify`), and a PASS/FAIL line. Exit status: 0 PASS, 1 FAIL, 2 the run could not start.

With --freeze-probe, a prober runs beside the load (benchmarks/freeze_probe.py): every
--probe-every seconds one hostile body of the kinds that can freeze a server (900-deep JSON, lone
surrogates, 60,000 tools, ...), a /health poller and bystander streams; the worst /health
latency (target < 1 s) and the bystanders' longest gap (< 2 s) join the verdict.

Bounded: --requests, --max-seconds and --max-rss-gb (the server's RSS); the server is
stopped (SIGTERM, then SIGKILL) by its PID on every way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

try:
    from benchmarks.freeze_probe import FreezeProber
    from benchmarks.http_load import Prompts, load_tokenizer
    from benchmarks.soak_server import (
        SAMPLE_HEAD,
        MiB,
        Sample,
        Server,
        drain,
        mb,
        print_sample,
        serve_options,
        take_sample,
        verify_log,
    )
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from freeze_probe import FreezeProber  # type: ignore[no-redef]
    from http_load import Prompts, load_tokenizer  # type: ignore[no-redef]
    from soak_server import (  # type: ignore[no-redef]
        SAMPLE_HEAD,
        MiB,
        Sample,
        Server,
        drain,
        mb,
        print_sample,
        serve_options,
        take_sample,
        verify_log,
    )

GROWTH_SLACK = 100 * MiB  # the target: growth <= prefix-cache budget + this
REPORT_EVERY = 100  # requests between two progress lines

# -- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request to send, drawn from the seeded mix."""

    index: int
    path: str  # /v1/chat/completions or /v1/completions
    body: dict[str, Any]
    stream: bool
    hang_up_after: int | None = None  # streamed: text chunks to read before hanging up
    hang_up_s: float | None = None  # not streamed: seconds to wait before hanging up


def make_specs(n: int, args: argparse.Namespace, prompts: Prompts, context: int) -> list[Spec]:
    """`n` requests, reproducible from `args.seed`; every prompt + max_tokens fits `context`."""
    rng = random.Random(args.seed)
    margin = 64  # chat template tokens, and the BPE's rounding at the cut
    long_len = min(1500, context - 128 - margin)
    lengths = [rng.randint(200, min(1000, long_len)) for _ in range(6)]
    systems = [(n, prompts.text(n, seed=10_000 + i)) for i, n in enumerate(lengths)]
    specs = []
    for i in range(n):
        max_tokens = rng.randint(8, 96)
        room = context - max_tokens - margin
        roll = rng.random()
        length = (
            rng.randint(8, 64) if roll < 0.5 else rng.randint(128, 512) if roll < 0.8 else long_len
        )
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.8}
        if rng.random() < 0.5:
            sampling |= {"temperature": 0.7, "seed": rng.randrange(2**31)}
        else:
            sampling["temperature"] = 0.0
        stream = rng.random() < 0.75
        if stream and rng.random() < 0.5:
            sampling["stream_options"] = {"include_usage": True}
        body: dict[str, Any]
        if rng.random() < 0.6:
            messages = []
            if rng.random() < 0.5:  # a shared system prompt: a prefix-cache hit
                num_system, system = rng.choice(systems)
                messages.append({"role": "system", "content": system})
                room -= num_system
            messages.append({"role": "user", "content": prompts.text(min(length, room), seed=i)})
            path, body = "/v1/chat/completions", {"messages": messages}
        else:
            path, body = "/v1/completions", {"prompt": prompts.text(min(length, room), seed=i)}
        hang_up = rng.random() < args.disconnect_frac
        specs.append(
            Spec(
                index=i,
                path=path,
                body={"model": args.model_name, **body, **sampling, "stream": stream},
                stream=stream,
                hang_up_after=rng.randint(0, max_tokens) if hang_up and stream else None,
                hang_up_s=rng.uniform(0.05, 3.0) if hang_up and not stream else None,
            )
        )
    return specs


# -- one request ------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # ok | hung-up | http-4xx | http-5xx | error-frame | unterminated
    status: int | None = None
    detail: str | None = None


async def send(client: httpx.AsyncClient, spec: Spec, timeout_s: float) -> Outcome:
    """Send `spec`; say how it ended as the client saw it."""
    try:
        if spec.stream:
            return await _streamed(client, spec, timeout_s)
        limit = timeout_s if spec.hang_up_s is None else min(spec.hang_up_s, timeout_s)
        try:
            async with asyncio.timeout(limit):
                r = await client.post(spec.path, json=spec.body)
        except TimeoutError:
            if spec.hang_up_s is not None and spec.hang_up_s < timeout_s:
                return Outcome("hung-up")
            return Outcome("unterminated", detail=f"no answer in {timeout_s:.0f} s")
        if r.status_code >= 400:
            return _http_error(r.status_code, r.text)
        choice = r.json()["choices"][0]
        if choice.get("finish_reason") is None:
            return Outcome("unterminated", 200, "a 200 answer without finish_reason")
        return Outcome("ok", 200)
    except (httpx.HTTPError, ValueError, LookupError) as exc:  # a closed connection, bad JSON
        return Outcome("unterminated", detail=f"{type(exc).__name__}: {exc}")


async def _streamed(client: httpx.AsyncClient, spec: Spec, timeout_s: float) -> Outcome:
    chunks, finished = 0, False
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.stream("POST", spec.path, json=spec.body) as r,
        ):
            if r.status_code != 200:
                return _http_error(r.status_code, (await r.aread()).decode(errors="replace"))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break
                if not line.startswith("data: "):
                    continue
                frame = json.loads(line[len("data: ") :])
                if "error" in frame:
                    return Outcome("error-frame", 200, str(frame["error"].get("message")))
                for choice in frame.get("choices") or ():
                    finished = finished or choice.get("finish_reason") is not None
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        chunks += 1
                if not finished and spec.hang_up_after is not None:
                    if chunks >= spec.hang_up_after:
                        return Outcome("hung-up", 200)  # leaving the block hangs up
        if finished:
            return Outcome("ok", 200)
        return Outcome("unterminated", 200, "the stream ended without finish_reason or error")
    except TimeoutError:
        return Outcome("unterminated", 200, f"no finish_reason in {timeout_s:.0f} s")


def _http_error(status: int, text: str) -> Outcome:
    kind = "http-5xx" if status >= 500 else "http-4xx"
    return Outcome(kind, status, f"HTTP {status}: {text[:200]}")


# -- the run ----------------------------------------------------------------------------------


@dataclass
class Tally:
    kinds: Counter[str] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)  # first words of every failure

    def add(self, out: Outcome) -> None:
        self.kinds[out.kind] += 1
        if out.kind not in ("ok", "hung-up"):
            self.details[f"{out.kind}: {(out.detail or '')[:160]}"] += 1

    @property
    def num_5xx(self) -> int:
        return self.kinds["http-5xx"] + self.kinds["error-frame"]

    @property
    def num_errors(self) -> int:
        return sum(n for k, n in self.kinds.items() if k not in ("ok", "hung-up"))

    @property
    def counts(self) -> tuple[int, int]:
        return self.num_5xx, self.num_errors


async def load(
    server: Server,
    specs: list[Spec],
    args: argparse.Namespace,
    t0: float,
    tally: Tally,
    samples: list[Sample],
) -> tuple[int, str | None]:
    """Send the specs, `args.concurrency` at a time, until done, --max-seconds or the server's
    RSS passes --max-rss-gb. Returns how many were sent, and why it stopped early (if so)."""
    queue = list(reversed(specs))
    done = 0
    stopped: str | None = None
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=None, limits=limits) as client,
        httpx.AsyncClient() as monitor,
    ):

        async def worker() -> None:
            nonlocal done
            while queue:
                out = await send(client, queue.pop(), args.request_timeout)
                tally.add(out)
                done += 1
                if done % REPORT_EVERY == 0:
                    samples.append(await take_sample(server, monitor, done, t0, tally.counts))
                    print_sample(samples[-1])

        async def watchdog(deadline: asyncio.Timeout) -> None:
            """Protects the machine: a leak must not take everyone's memory."""
            nonlocal stopped
            while True:
                await asyncio.sleep(0.5)
                rss = server.memory()["rss"]
                if rss is not None and rss > args.max_rss_gb * 2**30:
                    stopped = f"the server's RSS passed --max-rss-gb {args.max_rss_gb:g}"
                    deadline.reschedule(asyncio.get_running_loop().time())
                    return

        try:
            async with asyncio.timeout(args.max_seconds - (time.monotonic() - t0)) as deadline:
                dog = asyncio.create_task(watchdog(deadline))
                try:
                    async with asyncio.TaskGroup() as tg:
                        for _ in range(args.concurrency):
                            tg.create_task(worker())
                finally:
                    dog.cancel()
        except TimeoutError:
            stopped = stopped or f"--max-seconds {args.max_seconds:g} reached"
            print(f"{stopped}: the rest is not sent", flush=True)
    return done, stopped


def verdict(summary: dict[str, Any]) -> tuple[bool, list[str], list[str]]:
    """PASS against the targets: growth <= budget + 100 MiB, 0 unterminated, 0 5xx (and a
    server alive and healthy at the end). Also returns notes: what else looked wrong."""
    fails = [summary["stopped_early"]] if summary["stopped_early"] else []
    if summary["growth_bytes"] is None or summary["growth_bytes"] > summary["growth_limit_bytes"]:
        fails.append(
            f"RSS growth {mb(summary['growth_bytes'])} MB > {mb(summary['growth_limit_bytes'])} MB"
        )
    if summary["unterminated_total"]:
        fails.append(f"{summary['unterminated_total']} unterminated")
    if summary["num_5xx"]:
        fails.append(f"{summary['num_5xx']} 5xx")
    if summary["health_at_end"].get("status") != "ok":
        fails.append(f"/health at the end: {summary['health_at_end']}")
    if summary["server_exit"].startswith(("had exited", "did not exit")):
        fails.append(f"the server {summary['server_exit']}")
    freeze = summary.get("freeze")
    if freeze is not None and not freeze["pass"]:
        fails.append(
            f"freeze probe: /health worst {freeze['health_max_s']:.2f} s, longest stream gap "
            f"{freeze['gap_max_s']:.2f} s, {freeze['probe_5xx']} hostile bodies got a 5xx"
        )
    notes = []
    for when in ("before", "after"):
        report = summary[f"log_verify_{when}_stop"] or {}
        if "error" in report:  # then nobody counted the log's unterminated requests
            fails.append(f"the event log could not be verified ({when} stop): {report['error']}")
        elif report.get("violations"):
            notes.append(f"event log invariant violations ({when} stop): {report['violations']}")
    return not fails, fails, notes


async def run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    opts = serve_options(args.model, args.server_arg)  # refuses bad flags before any start
    server_args = list(args.server_arg)
    event_log = Path(opts.event_log) if opts.event_log else None
    if event_log is None and not args.no_event_log:
        event_log = work_dir / "events.jsonl"
        server_args += ["--event-log", str(event_log)]
    budget = int(opts.prefix_cache_gb * 2**30)  # as the engine counts it

    from stepline.engine.models import DEMO_MODELS, demo_model_path

    if args.model in DEMO_MODELS:
        demo_model_path(args.model)  # built here, once, not inside the server's start-up
    prompts = Prompts(load_tokenizer(args.model))
    server = Server(args.model, server_args, work_dir / "server.log")
    print(f"server: {' '.join(server.cmd)}  (pid {server.proc.pid}, log {server.log_path})")
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
            await server.wait_healthy(c)
            card = (await c.get("/v1/models")).json()["data"][0]
            args.model_name = card["id"]
            context = card.get("max_model_len") or 2048
            warm = Spec(-1, "/v1/completions", {"model": card["id"], "prompt": "Hi"}, False)
            out = await send(c, warm, args.request_timeout)
            if out.kind != "ok":
                raise SystemExit(f"the warm-up request failed: {out}\n" + server.log_tail())
            specs = make_specs(args.requests, args, prompts, context)
            t0 = time.monotonic()
            tally = Tally()
            start = await take_sample(server, c, 0, t0, tally.counts)
            print(SAMPLE_HEAD)
            print_sample(start, "start")
            samples: list[Sample] = [start]
            probing = asyncio.Event()
            prober = FreezeProber(server.base_url, every_s=args.probe_every, model=card["id"])
            probe = asyncio.create_task(prober.run(probing)) if args.freeze_probe else None
            try:
                sent, stopped = await load(server, specs, args, t0, tally, samples)
            finally:
                probing.set()
            freeze = (await probe).as_dict() if probe is not None else None
            if probe is not None:
                print("\n".join(prober.report.lines()))
            load_s = time.monotonic() - t0
            end = await take_sample(server, c, -1, t0, tally.counts)
            idle, held, probes = await drain(server, t0, tally.counts)
            try:
                health = (await c.get("/health")).json()
            except (httpx.HTTPError, ValueError) as exc:
                health = {"status": f"no answer: {exc!r}"}
            if idle is not None:
                print_sample(idle, "idle")
        log_report = verify_log(event_log) if event_log and event_log.exists() else None
    finally:
        server.stop()
    # The log's final lines are written by now; check again what shutdown added.
    final_log = verify_log(event_log) if event_log and event_log.exists() else None
    growth = None if idle is None or idle.rss is None or start.rss is None else idle.rss - start.rss
    unterminated_log = None if log_report is None else log_report.get("in_flight", 0)
    summary: dict[str, Any] = {
        "model": args.model,
        "server_args": server_args,
        "requests": args.requests,
        "finished": sent,
        "stopped_early": stopped,
        "concurrency": args.concurrency,
        "disconnect_frac": args.disconnect_frac,
        "seed": args.seed,
        "load_s": load_s,
        "outcomes": dict(tally.kinds),
        "num_5xx": tally.num_5xx,
        "num_http_5xx": tally.kinds["http-5xx"],
        "num_error_frames": tally.kinds["error-frame"],
        "failures": dict(tally.details.most_common(10)),
        "unterminated_client": tally.kinds["unterminated"],
        "unterminated_log": unterminated_log,
        "held_after_drain": held,
        "drain_probes": probes,  # 1-token requests sent to refresh stale gauges
        # The event log, where there is one, is the engine's own record: a request without
        # a terminal event there never ended. (Its /metrics gauges go stale when no step
        # runs; they stand in only without a log.) The client's count can overlap it, so the
        # total is the larger: at least that many were lost.
        "unterminated_total": max(
            tally.kinds["unterminated"],
            held or 0 if unterminated_log is None else unterminated_log,
        ),
        "event_log": str(event_log) if event_log else None,
        "log_verify_before_stop": log_report,
        "log_verify_after_stop": final_log,
        "prefix_cache_budget_bytes": budget,
        "growth_limit_bytes": budget + GROWTH_SLACK,
        "rss_start": start.rss,
        "rss_end_of_load": end.rss,
        "rss_idle": idle.rss if idle else None,
        "rss_peak": (idle or end).hwm,
        "growth_bytes": growth,
        "prefix_bytes_idle": idle.prefix_bytes if idle else None,
        "prefix_hits": (idle or end).prefix_hits,
        "prefix_cached_tokens": (idle or end).prefix_cached_tokens,
        "mlx_idle": None
        if idle is None
        else {"active": idle.mlx_active, "cache": idle.mlx_cache, "peak": idle.mlx_peak},
        "health_at_end": health,
        "freeze": freeze,
        "server_exit": server.exit_note,
        "samples": [asdict(s) for s in samples + [end] + ([idle] if idle else [])],
    }
    summary["pass"], summary["fails"], summary["notes"] = verdict(summary)
    return summary


def print_summary(s: dict[str, Any]) -> None:
    print()
    print(
        f"finished {s['finished']}/{s['requests']} requests in {s['load_s']:.0f} s, "
        f"{s['concurrency']} at a time; outcomes {s['outcomes']}"
    )
    print(
        f"RSS: start {mb(s['rss_start'])} MB, end of load {mb(s['rss_end_of_load'])} MB, "
        f"idle {mb(s['rss_idle'])} MB, peak {mb(s['rss_peak'])} MB; growth "
        f"{mb(s['growth_bytes'])} MB vs limit {mb(s['growth_limit_bytes'])} MB "
        f"(prefix-cache budget {mb(s['prefix_cache_budget_bytes'])} MB + 100 MB)"
    )
    mlx = s["mlx_idle"] or {}
    print(
        f"idle: prefix cache reports {mb(s['prefix_bytes_idle'])} MB; MLX active "
        f"{mb(mlx.get('active'))} MB, cache {mb(mlx.get('cache'))} MB, "
        f"peak {mb(mlx.get('peak'))} MB"
    )
    print(
        f"prefix cache: {s['prefix_hits']} hits, {s['prefix_cached_tokens']} prompt tokens "
        "served from it"
    )
    print(
        f"5xx: {s['num_5xx']} (HTTP {s['num_http_5xx']}, in-stream error frames "
        f"{s['num_error_frames']})"
    )
    in_log = "n/a" if s["unterminated_log"] is None else s["unterminated_log"]
    print(
        f"unterminated: {s['unterminated_total']} (clients {s['unterminated_client']}, "
        f"event log {in_log}; /metrics still counts {s['held_after_drain']} running after "
        f"the drain, {s['drain_probes']} probe requests sent)"
    )
    for name in ("log_verify_before_stop", "log_verify_after_stop"):
        if s[name] is not None:
            print(f"{name.replace('_', ' ')}: {s[name]}")
    for detail, n in s["failures"].items():
        print(f"  {n:>4} x {detail}")
    print(f"/health at the end: {s['health_at_end']}; server {s['server_exit']}")
    for note in s["notes"]:
        print(f"NOTE: {note} (not a target; `stepline replay LOG --verify` shows them)")
    print("PASS" if s["pass"] else "FAIL: " + "; ".join(s["fails"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python benchmarks/soak.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--requests", type=int, default=1000, help="requests to send (1000)")
    p.add_argument("--concurrency", type=int, default=64, help="requests at a time (64)")
    p.add_argument(
        "--disconnect-frac",
        type=float,
        default=0.3,
        help="fraction of clients that hang up at a random point (0.3)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (0)")
    p.add_argument(
        "--max-seconds", type=float, default=900, help="stop sending after this long (900)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=180,
        help="a request with no end after this long is unterminated (180 s)",
    )
    p.add_argument("--model", default="stepline-demo", help="served model (stepline-demo)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a `stepline serve` flag, repeatable: --server-arg=--prefix-cache-gb=0",
    )
    p.add_argument(
        "--max-rss-gb",
        type=float,
        default=8.0,
        help="stop sending when the server's RSS passes this (8 GiB): a leak must not take "
        "the machine's memory",
    )
    p.add_argument(
        "--no-event-log",
        action="store_true",
        help="no event log (by default the server writes one, checked at the end)",
    )
    p.add_argument(
        "--freeze-probe",
        action="store_true",
        help="beside the load, send a hostile body every --probe-every seconds and report "
        "the worst /health latency and bystander stream gap (benchmarks/freeze_probe.py)",
    )
    p.add_argument(
        "--probe-every", type=float, default=3.0, help="seconds between hostile bodies (3)"
    )
    p.add_argument("--keep", action="store_true", help="keep the server log and event log")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON ('-': stdout)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.disconnect_frac <= 1:
        p.error("--requests and --concurrency must be >= 1, --disconnect-frac in [0, 1]")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "longer than the maximum"
    # Ctrl-C, and SIGTERM, unwind through the finally clauses that stop the server, even
    # where the shell started this script with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    work_dir = Path(tempfile.mkdtemp(prefix="stepline-soak-"))
    try:
        summary = asyncio.run(run(args, work_dir))
    except KeyboardInterrupt:
        print("interrupted: the server is stopped", file=sys.stderr)
        return 130
    except SystemExit as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    finally:
        for server in Server.started:  # stopped already, unless a second Ctrl-C cut that short
            server.stop()
        if not args.keep:
            for f in work_dir.iterdir():
                f.unlink()
            work_dir.rmdir()
    print_summary(summary)
    if args.keep:
        print(f"kept: {work_dir}")
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
