"""Benchmark: what the prefix cache does for time to first token, stepline vs mlx_lm.server.

    .venv/bin/python benchmarks/prefix_bench.py [--no-mlx-lm] [--json OUT.json]

Both servers run one at a time on 127.0.0.1 (fresh processes, same model directory, same
BLAS: OpenBLAS is preloaded for mlx_lm.server too) and are driven with the same OpenAI
chat requests over HTTP (httpx, streaming); TTFT is the time from sending a request to its
first content chunk. mlx_lm.server runs with its own prompt cache at its defaults.

1. Shared prefix, on `stepline-demo-large`: a ~2,000-token system prompt and 16 short,
   distinct questions. Sequential: the first request is cold, the 15 after it can reuse
   the system prompt. Concurrent: one cold request on a new system prompt, then 16
   questions at once. Target: repeats at <= 0.2x the cold TTFT.
2. Multi-turn chat, 8 turns, on a hybrid (gated-delta `ArraysCache` + attention) model:
   per turn, TTFT against the tokens new in that turn and against the conversation
   length. The built-in `stepline-demo-hybrid` is too small to time (a whole prompt
   takes milliseconds), so by default this builds a larger one, `bench-hybrid-large`
   (qwen3_next, hidden 512, 8 layers, 6 of them gated-delta, 8 experts; ~40M parameters).
3. stepline's disk tier: the shared-prefix question after a server restart on the same
   `--prefix-cache-dir` (served from disk), then again (from memory).

Both servers get OPENBLAS_NUM_THREADS=1 unless `--blas-threads` says otherwise (see there).

Bounded: every request has a timeout, servers are stopped in `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

import stepline.engine  # noqa: F401 - OpenBLAS before MLX (for building the models)
from stepline.engine.models import DEMO_MODELS, DemoSpec, demo_model_path

HOST = "127.0.0.1"
CORPUS = Path(__file__).resolve().parents[1] / "engine" / "demo_corpus.txt"

BENCH_HYBRID = "bench-hybrid-large"
DEMO_MODELS.setdefault(
    BENCH_HYBRID,
    DemoSpec(
        arch="qwen3_next",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1536,
        max_position_embeddings=8192,
        seed=4,
        init_std=0.04,
        extra=(
            ("full_attention_interval", 4),
            ("head_dim", 64),
            ("partial_rotary_factor", 0.25),
            ("linear_num_value_heads", 8),
            ("linear_num_key_heads", 4),
            ("linear_key_head_dim", 64),
            ("linear_value_head_dim", 64),
            ("linear_conv_kernel_dim", 4),
            ("num_experts", 8),
            ("num_experts_per_tok", 2),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("moe_intermediate_size", 256),
            ("shared_expert_intermediate_size", 512),
            ("norm_topk_prob", True),
        ),
    ),
)

# mlx_lm.server, with OpenBLAS loaded first exactly as stepline does (fair BLAS).
MLX_LM_LAUNCHER = (
    "import sys, runpy; import stepline.engine; "
    "sys.argv = ['mlx_lm.server', *sys.argv[1:]]; "
    "runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
)


# -- servers --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base: str
    model_field: str | None  # the "model" to send; None: leave it out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(kind: str, model_dir: Path, log_dir: Path, extra: list[str]) -> Server:
    port = free_port()
    if kind == "stepline":
        cmd = [sys.executable, "-m", "stepline.api.cli", "serve", "--model", str(model_dir)]
        cmd += ["--loop-guard", "off"]  # the same answers as mlx_lm.server's: loops run on
    else:
        cmd = [sys.executable, "-c", MLX_LM_LAUNCHER, "--model", str(model_dir)]
    cmd += ["--host", HOST, "--port", str(port), *extra]
    log = open(log_dir / f"{kind}-{port}.log", "wb")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(kind, proc, f"http://{HOST}:{port}", None)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited ({proc.returncode}); see {log.name}")
        try:
            r = httpx.get(f"{server.base}/v1/models", timeout=2)
            if r.status_code == 200:
                if kind == "stepline":
                    server.model_field = r.json()["data"][0]["id"]
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{kind} server did not come up in 300 s")


# -- one request ----------------------------------------------------------------------


@dataclass
class Reply:
    ttft: float
    seconds: float
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None


async def chat(
    client: httpx.AsyncClient, server: Server, messages: list[dict], max_tokens: int
) -> Reply:
    body: dict = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server.model_field is not None:
        body["model"] = server.model_field
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    async with client.stream("POST", f"{server.base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if (piece or choice.get("finish_reason")) and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    seconds = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return Reply(
        ttft=ttft if ttft is not None else seconds,
        seconds=seconds,
        text="".join(text),
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
    )


# -- workloads ------------------------------------------------------------------------


def system_prompt(tokenizer, num_tokens: int, seed: int) -> str:
    paragraphs = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    random.Random(seed).shuffle(paragraphs)
    out: list[str] = [f"You are assistant number {seed}. Answer from this reference text."]
    while len(tokenizer.encode("\n\n".join(out)).ids) < num_tokens:
        out.append(paragraphs[len(out) % len(paragraphs)])
    return "\n\n".join(out)


def questions(n: int, seed: int) -> list[str]:
    words = sorted({w.strip(".,;:!?()\"'").lower() for w in CORPUS.read_text().split()} - {""})
    rng = random.Random(seed)
    return [
        f"Question {i}: in one sentence, what does the text say about {rng.choice(words)}?"
        for i in range(n)
    ]


@dataclass
class SharedPrefixResult:
    server: str
    sequential_ttft: list[float]
    sequential_cached: list[int | None]
    concurrent_cold_ttft: float
    concurrent_ttft: list[float]
    concurrent_cached: list[int | None]

    @property
    def sequential_ratio(self) -> float:
        return statistics.median(self.sequential_ttft[1:]) / self.sequential_ttft[0]

    @property
    def concurrent_ratio(self) -> float:
        return statistics.median(self.concurrent_ttft) / self.concurrent_cold_ttft


async def shared_prefix(
    server: Server, tokenizer, *, system_tokens: int, n: int, max_tokens: int
) -> SharedPrefixResult:
    qs = questions(n + 1, seed=1)
    async with httpx.AsyncClient(timeout=600) as client:
        await chat(client, server, [{"role": "user", "content": "hello"}], 2)  # warm-up
        system = system_prompt(tokenizer, system_tokens, seed=1)
        seq = [
            await chat(client, server, [{"role": "system", "content": system}, q_msg], max_tokens)
            for q_msg in ({"role": "user", "content": q} for q in qs[:n])
        ]
        system2 = system_prompt(tokenizer, system_tokens, seed=2)

        def msgs(q: str) -> list[dict]:
            return [{"role": "system", "content": system2}, {"role": "user", "content": q}]

        cold = await chat(client, server, msgs(qs[0]), max_tokens)
        burst = await asyncio.gather(*(chat(client, server, msgs(q), max_tokens) for q in qs[1:]))
    return SharedPrefixResult(
        server=server.name,
        sequential_ttft=[r.ttft for r in seq],
        sequential_cached=[r.cached_tokens for r in seq],
        concurrent_cold_ttft=cold.ttft,
        concurrent_ttft=[r.ttft for r in burst],
        concurrent_cached=[r.cached_tokens for r in burst],
    )


# Words per user message, turn by turn: not monotonic, so "new tokens" and "conversation
# length" are not the same curve.
TURN_WORDS = (160, 20, 110, 10, 200, 40, 90, 15)


@dataclass
class Turn:
    prompt_tokens: int
    new_tokens: int  # prompt tokens not in the previous turn's prompt
    cached_tokens: int | None
    ttft: float


@dataclass
class ChatResult:
    server: str
    turns: list[Turn] = field(default_factory=list)
    cold_last_ttft: float = 0.0  # the last turn's whole prompt, with nothing cached

    def corr(self, attr: str) -> float:
        xs = [getattr(t, attr) for t in self.turns[1:]]
        ys = [t.ttft for t in self.turns[1:]]
        return statistics.correlation(xs, ys) if len(xs) > 2 else float("nan")


def render_len(tokenizer_wrapper, messages: list[dict]) -> int:
    text = tokenizer_wrapper.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer_wrapper.encode(text, add_special_tokens=False))


async def multi_turn(server: Server, chat_tokenizer, raw_tokenizer, *, turns: int) -> ChatResult:
    words = CORPUS.read_text(encoding="utf-8").split()
    rng = random.Random(7)
    system = system_prompt(raw_tokenizer, 400, seed=3)
    messages: list[dict] = [{"role": "system", "content": system}]
    result = ChatResult(server.name)
    previous = 0
    async with httpx.AsyncClient(timeout=600) as client:
        await chat(client, server, [{"role": "user", "content": "hello"}], 2)  # warm-up
        for k in range(turns):
            n = TURN_WORDS[k % len(TURN_WORDS)]
            start = rng.randrange(0, len(words) - n)
            messages.append({"role": "user", "content": " ".join(words[start : start + n])})
            length = render_len(chat_tokenizer, messages)
            reply = await chat(client, server, messages, 24)
            result.turns.append(Turn(length, length - previous, reply.cached_tokens, reply.ttft))
            messages.append({"role": "assistant", "content": reply.text})
            previous = length
        # The same conversation with a different first word: nothing of it is cached.
        cold = [{"role": "system", "content": "Note. " + system}, *messages[1:-1]]
        result.cold_last_ttft = (await chat(client, server, cold, 24)).ttft
    return result


def cache_files(directory: Path) -> tuple[int, int]:
    """(number of files, bytes) of the prefix-cache files in `directory`."""
    sizes = [f.stat().st_size for f in directory.glob("*.safetensors")]
    return len(sizes), sum(sizes)


async def disk_restart(
    model_dir: Path, tokenizer, log_dir: Path, *, system_tokens: int, max_tokens: int
) -> dict:
    cache_dir = Path(tempfile.mkdtemp(prefix="stepline-prefix-disk-"))
    system = system_prompt(tokenizer, system_tokens, seed=5)
    qs = questions(3, seed=5)

    def msgs(q: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    extra = ["--prefix-cache-dir", str(cache_dir)]
    try:
        first = start_server("stepline", model_dir, log_dir, extra)
        try:
            async with httpx.AsyncClient(timeout=600) as client:
                await chat(client, first, [{"role": "user", "content": "hello"}], 2)
                cold = await chat(client, first, msgs(qs[0]), max_tokens)
        finally:
            first.stop()  # exits after the queued writes land
        files = cache_files(cache_dir)
        second = start_server("stepline", model_dir, log_dir, extra)
        try:
            async with httpx.AsyncClient(timeout=600) as client:
                await chat(client, second, [{"role": "user", "content": "hello"}], 2)
                from_disk = await chat(client, second, msgs(qs[1]), max_tokens)
                from_memory = await chat(client, second, msgs(qs[2]), max_tokens)
        finally:
            second.stop()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {
        "files_after_first_server": files[0],
        "bytes_after_first_server": files[1],
        "cold_ttft": cold.ttft,
        "disk_ttft": from_disk.ttft,
        "disk_cached_tokens": from_disk.cached_tokens,
        "memory_ttft": from_memory.ttft,
        "memory_cached_tokens": from_memory.cached_tokens,
    }


# -- report ---------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x * 1000:8.0f} ms"


def print_shared(r: SharedPrefixResult, system_tokens: int) -> None:
    seq = r.sequential_ttft
    print(f"\n[{r.server}] shared ~{system_tokens}-token system prompt, {len(seq)} questions")
    print(
        f"  sequential: first (cold) {ms(seq[0])}; repeats median {ms(statistics.median(seq[1:]))}"
        f", max {ms(max(seq[1:]))}  -> {r.sequential_ratio:.3f}x  (cached tokens of repeats:"
        f" {sorted(set(r.sequential_cached[1:]), key=str)})"
    )
    print(
        f"  concurrent: cold first {ms(r.concurrent_cold_ttft)}; {len(r.concurrent_ttft)} at once"
        f" median {ms(statistics.median(r.concurrent_ttft))}, max {ms(max(r.concurrent_ttft))}"
        f"  -> {r.concurrent_ratio:.3f}x"
    )


def print_chat(r: ChatResult) -> None:
    print(f"\n[{r.server}] multi-turn chat")
    print("  turn  prompt  new  cached     TTFT")
    for k, t in enumerate(r.turns, 1):
        print(
            f"  {k:4d} {t.prompt_tokens:7d} {t.new_tokens:4d} {t.cached_tokens!s:>7} {ms(t.ttft)}"
        )
    print(f"  last turn's prompt with nothing cached: {ms(r.cold_last_ttft)}")
    print(
        f"  correlation of TTFT (turns 2..) with new tokens {r.corr('new_tokens'):+.2f}, "
        f"with conversation length {r.corr('prompt_tokens'):+.2f}"
    )


async def main_async(args: argparse.Namespace) -> dict:
    from mlx_lm.tokenizer_utils import load as load_tokenizer  # slow import: only here
    from tokenizers import Tokenizer

    large = demo_model_path(args.model) if args.model in DEMO_MODELS else Path(args.model)
    hybrid = demo_model_path(args.hybrid) if args.hybrid in DEMO_MODELS else Path(args.hybrid)
    raw_large = Tokenizer.from_file(str(large / "tokenizer.json"))
    raw_hybrid = Tokenizer.from_file(str(hybrid / "tokenizer.json"))
    chat_hybrid = load_tokenizer(hybrid)
    log_dir = Path(tempfile.mkdtemp(prefix="prefix-bench-logs-"))
    kinds = ["stepline"] + ([] if args.no_mlx_lm else ["mlx_lm"])
    report: dict = {"model": str(large), "hybrid": str(hybrid), "logs": str(log_dir)}

    parts = set(args.only or ("shared", "chat", "disk"))
    for kind in kinds if "shared" in parts else ():
        server = start_server(kind, large, log_dir, [])
        try:
            r = await shared_prefix(
                server,
                raw_large,
                system_tokens=args.system_tokens,
                n=args.questions,
                max_tokens=args.max_tokens,
            )
        finally:
            server.stop()
        print_shared(r, args.system_tokens)
        report[f"shared_prefix/{kind}"] = {
            **asdict(r),
            "sequential_ratio": r.sequential_ratio,
            "concurrent_ratio": r.concurrent_ratio,
        }

    for kind in kinds if "chat" in parts else ():
        server = start_server(kind, hybrid, log_dir, [])
        try:
            c = await multi_turn(server, chat_hybrid, raw_hybrid, turns=args.turns)
        finally:
            server.stop()
        print_chat(c)
        report[f"multi_turn/{kind}"] = {
            **asdict(c),
            "corr_new_tokens": c.corr("new_tokens"),
            "corr_conversation_length": c.corr("prompt_tokens"),
        }

    if "disk" in parts and not args.no_disk:
        d = await disk_restart(
            large, raw_large, log_dir, system_tokens=args.system_tokens, max_tokens=args.max_tokens
        )
        print(
            f"\n[stepline] disk tier, after a restart: cold {ms(d['cold_ttft'])}, from disk "
            f"{ms(d['disk_ttft'])} ({d['disk_cached_tokens']} tokens), then from memory "
            f"{ms(d['memory_ttft'])}; {d['files_after_first_server']} files, "
            f"{d['bytes_after_first_server'] / 2**20:.1f} MiB"
        )
        report["disk_restart/stepline"] = d
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="stepline-demo-large", help="shared-prefix model")
    p.add_argument("--hybrid", default=BENCH_HYBRID, help="multi-turn model (hybrid)")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="per shared-prefix question")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--no-mlx-lm", action="store_true", help="stepline only")
    p.add_argument("--no-disk", action="store_true", help="skip the disk-tier restart")
    p.add_argument(
        "--only",
        action="append",
        choices=["shared", "chat", "disk"],
        help="run only these parts (repeatable; default: all)",
    )
    p.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OPENBLAS_NUM_THREADS for both servers (default 1; 0 = OpenBLAS's default)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.blas_threads > 0:
        # On a small shared machine OpenBLAS's spinning worker threads collapse when another
        # process wants the cores (a 10-token forward: 0.05 s alone, 0.75 s), which swamps
        # any cache effect; one thread per server measures the caches, not the scheduler.
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    report = asyncio.run(main_async(args))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
