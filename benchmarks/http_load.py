"""A load generator for OpenAI-compatible servers: stepline against mlx_lm.server.

    # spawn each server on the demo model in turn, run every workload, compare:
    python -m benchmarks.http_load --spawn stepline,mlx_lm
    # or point it at a server that is already running (127.0.0.1 only):
    python -m benchmarks.http_load --base-url http://127.0.0.1:8000 --model stepline-demo

Workloads (all greedy, streamed over SSE, with `stream_options.include_usage`):
  head-of-line  4 long decodes; once they stream, one long prompt (~4,000 tokens, cut to the
                model's context) arrives. Its TTFT, and the decoders' worst inter-token gap
                while it prefills, show whether a long prefill stalls running decodes.
  burst         16 requests at once, prompts of 64-256 tokens, 96-160 output tokens each
                (`ignore_eos`: stepline generates them all; peers that ignore the field stop
                early, so compare tokens/s, which is per output token).
  shared-prefix one long system prompt, 16 short questions, 4 at a time.
  overhead      16 identical streams, through HTTP and through the engine's Python API in
                this process (stepline only): the HTTP layer's cost in output tokens/s.

Prints TTFT, ITL (gap between streamed chunks), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E
latency at p50/p90/p99, and output tokens/s. Bounded: a fixed number of requests per
workload, a per-request timeout and an overall `--time-limit`; it only talks to 127.0.0.1.

mlx_lm.server is started through a wrapper that loads OpenBLAS first (as stepline does), or
on Linux its CPU matmuls would use MLX's reference BLAS and the comparison would be unfair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# Every server samples the same way: a model's own repetition penalty (stepline's default
# model has 1.1 in its generation_config.json) is turned off, as greedy runs elsewhere are.
NO_PENALTY = {"repetition_penalty": 1.0}


# -- one request ------------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    start: float  # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    *,
    limit_s: float,
    on_chunk: Any = None,
) -> Result:
    """Send one streaming request; time every text chunk; read usage from the last chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, start=time.perf_counter())
    try:
        async with asyncio.timeout(limit_s), client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    res.ok = res.error is None
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    continue
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens", 0) or 0
                for choice in obj.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if text:
                        res.chunk_times.append(time.perf_counter())
                        if on_chunk is not None:
                            on_chunk(len(res.chunk_times))
    except (TimeoutError, httpx.HTTPError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    if not res.output_tokens:  # a server without usage: count chunks instead
        res.output_tokens = len(res.chunk_times)
    return res


# -- prompts ----------------------------------------------------------------------------------


class Prompts:
    """Prompts of (about) a given number of tokens, cut from the demo corpus. With a tokenizer
    the counts are exact; without, ~3 characters a token is assumed."""

    def __init__(self, tokenizer: Any = None):
        from importlib.resources import files

        self.words = (files("stepline.engine") / "demo_corpus.txt").read_text().split()
        self.tokenizer = tokenizer

    def text(self, num_tokens: int, seed: int) -> str:
        rng = random.Random(seed)
        start = rng.randrange(len(self.words))
        words = [self.words[(start + i) % len(self.words)] for i in range(num_tokens * 2)]
        text = " ".join(words)
        if self.tokenizer is None:
            return text[: num_tokens * 3]
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
        return self.tokenizer.decode(ids)


# -- workloads --------------------------------------------------------------------------------


@dataclass
class Run:
    workload: str
    server: str
    results: list[Result]
    wall: float
    notes: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    name: str  # "stepline", "mlx_lm", or the base URL
    base_url: str
    model: str
    context: int | None  # the model's context length, where known
    pid: int | None = None  # the server's process, when spawned: its CPU time is measured


def chat(model: str, user: str, max_tokens: int, system: str | None = None) -> dict:
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    # ignore_eos: stepline generates exactly max_tokens; other servers ignore the field.
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **NO_PENALTY,
    }


async def head_of_line(t: Target, client, prompts: Prompts, args) -> Run:
    num_long = args.hol_prompt_tokens
    if t.context is not None:
        num_long = min(num_long, t.context - 64)
    streaming = asyncio.Event()
    counts = [0] * 4

    def seen(i: int):
        def on_chunk(n: int) -> None:
            counts[i] = n
            if all(c >= 8 for c in counts):
                streaming.set()

        return on_chunk

    t0 = time.perf_counter()
    decoders = [
        asyncio.create_task(
            stream_request(
                client,
                "/v1/chat/completions",
                chat(t.model, prompts.text(64, seed=i), args.hol_decode_tokens),
                limit_s=args.request_timeout,
                on_chunk=seen(i),
            )
        )
        for i in range(4)
    ]
    await asyncio.wait_for(streaming.wait(), args.request_timeout)
    long = await stream_request(
        client,
        "/v1/completions",
        {
            "model": t.model,
            "prompt": prompts.text(num_long, seed=99),
            "max_tokens": 16,
            "temperature": 0.0,
            "ignore_eos": True,
            **NO_PENALTY,
        },
        limit_s=args.request_timeout,
    )
    results = [*await asyncio.gather(*decoders), long]
    # The decoders' gaps while the long prompt was being prefilled (send -> its first token).
    window_end = long.chunk_times[0] if long.chunk_times else long.end
    gaps = [
        b - a
        for r in results[:4]
        for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
        if b >= long.start and a <= window_end
    ]
    notes = {
        "long_prompt_tokens": long.prompt_tokens,
        "long_ttft_ms": 1000 * (long.ttft or float("nan")),
        "decode_stall_max_ms": 1000 * max(gaps, default=float("nan")),
    }
    return Run("head-of-line", t.name, results, time.perf_counter() - t0, notes)


async def burst(t: Target, client, prompts: Prompts, args) -> Run:
    rng = random.Random(0)
    (plo, phi), (olo, ohi) = args.burst_prompt, args.burst_output
    # Texts of their own: head-of-line's decoders took seeds 0-3, and a server that ran it
    # first served the burst's first prompts from its prefix cache.
    bodies = [
        chat(t.model, prompts.text(rng.randint(plo, phi), seed=10_000 + i), rng.randint(olo, ohi))
        for i in range(args.burst)
    ]
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[
            stream_request(client, "/v1/chat/completions", b, limit_s=args.request_timeout)
            for b in bodies
        ]
    )
    return Run("burst", t.name, list(results), time.perf_counter() - t0)


async def shared_prefix(t: Target, client, prompts: Prompts, args) -> Run:
    num_prefix = args.prefix_tokens
    if t.context is not None:
        num_prefix = min(num_prefix, t.context - 128)
    system = prompts.text(num_prefix, seed=7)
    gate = asyncio.Semaphore(4)

    async def ask(i: int) -> Result:
        async with gate:
            body = chat(t.model, f"Question {i}: {prompts.text(16, seed=100 + i)}?", 32, system)
            return await stream_request(
                client, "/v1/chat/completions", body, limit_s=args.request_timeout
            )

    t0 = time.perf_counter()
    results = await asyncio.gather(*[ask(i) for i in range(args.questions)])
    notes = {"cached_tokens_total": sum(r.cached_tokens for r in results)}
    return Run("shared-prefix", t.name, list(results), time.perf_counter() - t0, notes)


def overhead_bodies(model: str, prompts: Prompts, args) -> list[dict]:
    return [
        chat(model, prompts.text(64, seed=200 + i), args.overhead_tokens)
        for i in range(args.streams)
    ]


async def overhead_http(t: Target, client, prompts: Prompts, args) -> Run:
    bodies = overhead_bodies(t.model, prompts, args)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[
            stream_request(client, "/v1/chat/completions", b, limit_s=args.request_timeout)
            for b in bodies
        ]
    )
    return Run(f"overhead-{args.streams}", t.name, list(results), time.perf_counter() - t0)


async def overhead_engine(model_name: str, prompts: Prompts, args) -> Run:
    """The same streams as `overhead_http`, through the Python API in this process."""
    from stepline.api import Engine, SamplingParams

    bodies = overhead_bodies(model_name, prompts, args)
    async with Engine.open(model_name, max_num_seqs=max(32, args.streams)) as engine:

        async def one(body: dict) -> Result:
            res = Result(ok=False, start=time.perf_counter())
            params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0, ignore_eos=True)
            async for out in engine.generate(messages=body["messages"], params=params):
                if out.text:
                    res.chunk_times.append(time.perf_counter())
                if out.finish_reason is not None:
                    res.ok = out.finish_reason in ("stop", "length")
                    res.prompt_tokens = out.num_prompt_tokens
                    res.output_tokens = out.num_output_tokens
            res.end = time.perf_counter()
            return res

        await one(bodies[0])  # warm-up
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*[one(b) for b in bodies])
        run = Run(
            f"overhead-{args.streams}", "stepline-engine", list(results), time.perf_counter() - t0
        )
        return with_cpu_note(run, time.process_time() - cpu0)


# -- report -----------------------------------------------------------------------------------


def percentiles(values: Sequence[float], ps=(50, 90, 99)) -> list[float]:
    """Nearest-rank percentiles; NaN for no values."""
    if not values:
        return [float("nan")] * len(ps)
    s = sorted(values)
    return [s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))] for p in ps]


def ms(values: Sequence[float]) -> str:
    return "/".join(f"{1000 * v:.0f}" if v == v else "-" for v in percentiles(values))


def summary(run: Run) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "workload": run.workload,
        "server": run.server,
        "requests": len(run.results),
        "ok": len(ok),
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / run.wall if run.wall else 0.0,
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": ms([g for r in ok for g in r.itls]),
        "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in run.results if r.error})[:3],
        **run.notes,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<14} {'server':<16} {'ok':>5} {'out tok':>8} {'tok/s':>8}  "
        f"{'TTFT ms p50/90/99':<20} {'ITL ms p50/90/99':<18} {'TPOT ms p50/90/99':<18} "
        f"{'E2E ms p50/90/99':<20}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['workload']:<14} {r['server']:<16} {r['ok']:>2}/{r['requests']:<2} "
            f"{r['output_tokens']:>8} {r['tokens_per_s']:>8.1f}  {r['ttft_ms']:<20} "
            f"{r['itl_ms']:<18} {r['tpot_ms']:<18} {r['e2e_ms']:<20}"
        )
        extra = {
            k: v
            for k, v in r.items()
            if k not in {"workload", "server", "requests", "ok", "output_tokens"}
            and not k.endswith(("_ms", "_per_s"))
            and k != "errors"
        }
        extra |= {k: v for k, v in r.items() if k.endswith("_ms") and isinstance(v, float)}
        if extra:
            print("    " + ", ".join(f"{k}={v:.0f}" for k, v in extra.items()))
        if r["errors"]:
            print(f"    errors: {r['errors']}")


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned:
    """A server process on 127.0.0.1, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self,
        kind: str,
        model_name: str,
        log_dir: Path,
        stepline_args: list[str],
        peer_args: Sequence[str] = (),
        vllm_mlx_bin: str | None = None,
    ):
        from benchmarks.served_model import served_dir
        from stepline.engine.models import DEMO_MODELS

        self.kind = kind
        self.port = free_port()
        env = None  # this process's
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Built (or converted and saved as served) once, before any server starts.
        path = served_dir(model_name)
        if model_name in DEMO_MODELS:
            self.context = DEMO_MODELS[model_name].max_position_embeddings
        else:
            config = path / "config.json"  # read, not loaded: no model in this process
            self.context = (
                json.loads(config.read_text()).get("max_position_embeddings")
                if config.is_file()
                else None
            )
        if kind == "stepline":
            # A demo by name; a real model as the same directory the peers read.
            self.model = model_name if model_name in DEMO_MODELS else str(path)
            cmd = [sys.executable, "-m", "stepline.api.cli", "serve", "--model", self.model]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port), *stepline_args]
        elif kind == "mlx_lm":
            self.model = str(path)
            wrapper = (
                "import sys, runpy; import stepline.engine; "  # loads OpenBLAS before MLX
                "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')"
            )
            cmd = [sys.executable, "-c", wrapper, "--model", str(path)]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING"]
            cmd += list(peer_args)
        elif kind == "vllm_mlx":
            self.model = str(path)
            exe = vllm_mlx_bin or shutil.which("vllm-mlx")
            if exe is None:
                raise SystemExit("--spawn vllm_mlx: no vllm-mlx on PATH (or --vllm-mlx-bin)")
            cmd = [exe, "serve", str(path), "--host", "127.0.0.1", "--port", str(self.port)]
            cmd += list(peer_args)
            # vllm-mlx runs in an environment of its own: OpenBLAS goes in as stepline loads
            # it (this process loaded it), with the same number of threads
            import mlx.core  # noqa: F401  (stepline.engine loads OpenBLAS before it)

            from stepline.engine import _blas

            openblas, _ = _blas.status()
            if openblas is not None:
                env = {**os.environ, "LD_PRELOAD": openblas}
        else:
            raise SystemExit(f"--spawn: unknown server {kind!r} (stepline, mlx_lm or vllm_mlx)")
        self.log_path = log_dir / f"{kind}.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    async def wait_ready(self, limit_s: float = 180) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5) as client:
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise SystemExit(
                        f"{self.kind} exited with {self.proc.returncode}; see {self.log_path}"
                    )
                try:
                    if (await client.get("/v1/models")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise SystemExit(f"{self.kind} not ready after {limit_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- main -------------------------------------------------------------------------------------

WORKLOADS = {"head-of-line": head_of_line, "burst": burst, "shared-prefix": shared_prefix}


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads) so far; Linux only."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_cpu_note(run: Run, cpu_s: float | None) -> Run:
    tokens = sum(r.output_tokens for r in run.results if r.ok)
    if cpu_s is not None and tokens:
        # CPU per output token, unlike wall time, barely moves when other work shares the cores.
        run.notes["server_cpu_us_per_token"] = 1e6 * cpu_s / tokens
    return run


async def run_target(t: Target, prompts: Prompts, args, deadline: float) -> list[Run]:
    runs = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=t.base_url, timeout=None, limits=limits) as client:
        warm = await stream_request(
            client, "/v1/chat/completions", chat(t.model, "Hello", 4), limit_s=60
        )
        if not warm.ok:
            raise SystemExit(f"{t.name}: warm-up request failed: {warm.error}")
        for name in args.workloads:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                print(f"[{t.name}] time limit reached; skipping {name}", file=sys.stderr)
                continue
            fn = overhead_http if name == "overhead" else WORKLOADS[name]
            print(f"[{t.name}] {name} ...", file=sys.stderr, flush=True)
            cpu0 = process_cpu_s(t.pid)
            async with asyncio.timeout(remaining):
                run = await fn(t, client, prompts, args)
            cpu1 = process_cpu_s(t.pid)
            runs.append(with_cpu_note(run, None if cpu0 is None else cpu1 - cpu0))
    return runs


def load_tokenizer(model_name: str) -> Any:
    try:
        from transformers import AutoTokenizer

        from benchmarks.served_model import served_dir

        return AutoTokenizer.from_pretrained(str(served_dir(model_name)))
    except Exception as exc:  # noqa: BLE001 - approximate lengths are still a benchmark
        print(f"no tokenizer ({exc}); prompt lengths are approximate", file=sys.stderr)
        return None


async def main_async(args, runs: list[Run]) -> list[dict[str, Any]]:
    """Every workload on every server (`runs` gets each run), their summary rows."""
    deadline = time.monotonic() + args.time_limit
    rows: list[dict[str, Any]] = []
    spawn = [s for s in (args.spawn or "").split(",") if s]
    prompts = Prompts(load_tokenizer(args.model) if (spawn or args.tokenizer) else None)
    if "overhead" in args.workloads and "stepline" in spawn:
        # First, alone on the machine (before any server starts): the engine's own
        # throughput, no HTTP. Only with --spawn: a server already running would compete.
        print("[stepline-engine] overhead ...", file=sys.stderr, flush=True)
        rows.append(summary(await overhead_engine(args.model, prompts, args)))
    if not spawn:
        host = urlparse(args.base_url).hostname
        if host not in LOOPBACK:
            raise SystemExit(f"--base-url must be on 127.0.0.1 (got {host})")
        t = Target(args.base_url, args.base_url.rstrip("/"), args.model, args.context)
        rows += [summary(r) for r in await run_target(t, prompts, args, deadline)]
        return rows
    with tempfile.TemporaryDirectory(prefix="http-load-") as log_dir:
        for r in range(args.repeats):
            # one server at a time (they would fight over the same cores), a fresh one each
            # repeat (no prefix cache carried over), in an order that rotates
            for kind in spawn[r % len(spawn) :] + spawn[: r % len(spawn)]:
                extra = [*args.peer_args.split(), *getattr(args, f"{kind}_args", "").split()]
                server = Spawned(
                    kind,
                    args.model,
                    Path(log_dir),
                    args.stepline_args.split(),
                    extra,
                    args.vllm_mlx_bin,
                )
                try:
                    await server.wait_ready()
                    t = Target(kind, server.base_url, server.model, server.context, server.proc.pid)
                    for run in await run_target(t, prompts, args, deadline):
                        rows.append({**summary(run), "repeat": r + 1})
                        runs.append(run)
                finally:
                    server.stop()
    return rows


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    return lo, hi


# What each workload's comparison reads from a run, and whether more is better.
FIGURES = {
    "tok/s": (lambda run: summary(run)["tokens_per_s"], True),
    "TTFT p50 (s)": (
        lambda run: percentiles([r.ttft for r in run.results if r.ok and r.ttft])[0],
        False,
    ),
    "ITL p50 (s)": (
        lambda run: percentiles([g for r in run.results if r.ok for g in r.itls])[0],
        False,
    ),
    "stall (ms)": (lambda run: run.notes.get("decode_stall_max_ms", float("nan")), False),
}


def compare(runs: list[Run]) -> None:
    """Each workload's figures on each server (medians over repeats), and stepline's against
    the best peer's for each figure (the median of the repeats' ratios, repeat i of stepline
    against repeat i of the peer)."""
    import statistics

    by: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        by.setdefault((run.workload, run.server), []).append(run)
    for workload in dict.fromkeys(run.workload for run in runs):
        servers = [srv for (w, srv) in by if w == workload]
        if "stepline" not in servers or len(servers) < 2:
            continue
        print(f"\n{workload}: medians of {len(by[(workload, 'stepline')])} repeat(s)")
        for name, (figure, more_is_better) in FIGURES.items():
            values = {srv: [figure(run) for run in by[(workload, srv)]] for srv in servers}
            if all(v != v for vs in values.values() for v in vs):  # NaN everywhere
                continue
            medians = {srv: statistics.median(vs) for srv, vs in values.items()}
            peers = [srv for srv in servers if srv != "stepline"]
            best = (max if more_is_better else min)(peers, key=lambda srv: medians[srv])
            ratios = [a / b for a, b in zip(values["stepline"], values[best], strict=False) if b]
            shown = ", ".join(f"{srv} {medians[srv]:.3g}" for srv in servers)
            ratio = statistics.median(ratios) if ratios else float("nan")
            print(f"  {name:<13} {shown}; stepline / {best} (best peer): {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.http_load", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load")
    p.add_argument("--model", default="stepline-demo", help="model name (and spawned model)")
    p.add_argument(
        "--spawn",
        default=None,
        help="comma-separated servers to start on --model, one after the other: stepline,mlx_lm",
    )
    p.add_argument("--stepline-args", default="", help="extra `stepline serve` arguments")
    p.add_argument(
        "--peer-args",
        default="",
        help="extra arguments of the peer spawned (e.g. mlx_lm.server's best chunked "
        "configuration: '--prefill-step-size 512')",
    )
    p.add_argument(
        "--workloads",
        default="head-of-line,burst,shared-prefix,overhead",
        type=lambda s: [w for w in s.split(",") if w],
    )
    p.add_argument("--context", type=int, default=None, help="model context (with --base-url)")
    p.add_argument("--tokenizer", action="store_true", help="load --model's tokenizer")
    p.add_argument("--hol-prompt-tokens", type=int, default=4000)
    p.add_argument("--hol-decode-tokens", type=int, default=256)
    p.add_argument("--burst", type=int, default=16, help="requests in the burst")
    p.add_argument("--burst-prompt", type=span, default=(64, 256), help="prompt tokens, LO-HI")
    p.add_argument("--burst-output", type=span, default=(96, 160), help="output tokens, LO-HI")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of every spawned server, in turn (medians)"
    )
    p.add_argument("--mlx-lm-args", dest="mlx_lm_args", default="", help="mlx_lm.server's own")
    p.add_argument("--vllm-mlx-args", dest="vllm_mlx_args", default="", help="vllm-mlx's own")
    p.add_argument("--vllm-mlx-bin", default=None, help="the vllm-mlx executable (default: PATH's)")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--streams", type=int, default=16, help="streams of the overhead workload")
    p.add_argument("--overhead-tokens", type=int, default=128)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="also write the summary rows to this file")
    args = p.parse_args(argv)
    unknown = set(args.workloads) - {*WORKLOADS, "overhead"}
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {[*WORKLOADS, 'overhead']}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    runs: list[Run] = []
    rows = asyncio.run(main_async(args, runs))
    print_table(rows)
    compare(runs)
    engine = next((r for r in rows if r["server"] == "stepline-engine"), None)
    http = next(
        (
            r
            for r in rows
            if r["workload"] == f"overhead-{args.streams}"
            and r["server"] not in ("mlx_lm", "stepline-engine")
        ),
        None,
    )
    if engine and http and engine["tokens_per_s"]:
        cost = 1 - http["tokens_per_s"] / engine["tokens_per_s"]
        print(
            f"\nHTTP overhead at {args.streams} streams: {http['tokens_per_s']:.1f} tok/s over "
            f"HTTP vs {engine['tokens_per_s']:.1f} tok/s in-process = {100 * cost:.1f}% cost"
        )
        cpu_e = engine.get("server_cpu_us_per_token")
        cpu_h = http.get("server_cpu_us_per_token")
        if cpu_e and cpu_h:
            print(
                f"server CPU per output token: {cpu_h:.0f} us over HTTP vs {cpu_e:.0f} us "
                f"in-process = {100 * (cpu_h / cpu_e - 1):.1f}% more"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
