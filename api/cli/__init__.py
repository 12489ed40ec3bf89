"""The `stepline` command: generate, serve, replay, gateway."""

from __future__ import annotations

import argparse
import sys
import time

import anyio

from stepline.api.cli.flags import add_engine_args, engine_kwargs

__all__ = ["add_engine_args", "engine_kwargs", "main"]


async def _generate(args: argparse.Namespace) -> int:
    from stepline.api import Engine, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    content: str | list[dict] = args.prompt
    if args.image or args.audio:  # the media first, then the question (as such chats go)
        content = [
            *[{"type": "image", "image": await anyio.Path(f).read_bytes()} for f in args.image],
            *[{"type": "audio", "audio": await anyio.Path(f).read_bytes()} for f in args.audio],
            {"type": "text", "text": args.prompt},
        ]
    async with Engine.open(args.model, **engine_kwargs(args)) as engine:
        t0 = time.perf_counter()
        first = None
        last = None
        source = (
            {"prompt": args.prompt}
            if args.raw
            else {"messages": [{"role": "user", "content": content}]}
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
    g.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        default=[],
        help="an image file to ask about (a vision model: e.g. --model stepline-demo-vision, "
        "stepline-demo-vision-qwen, or stepline-demo-omni with --audio too); repeat for several",
    )
    g.add_argument(
        "--audio",
        action="append",
        metavar="FILE",
        default=[],
        help="a WAV, MP3 or FLAC file to ask about (an audio model: e.g. --model "
        "stepline-demo-audio, or stepline-demo-omni with --image too); repeat for several",
    )
    add_engine_args(g)

    from stepline.api.cli.gateway import add_gateway_parser
    from stepline.api.cli.replay import add_replay_parser
    from stepline.api.cli.serve import add_serve_parser

    add_serve_parser(sub)
    add_replay_parser(sub)
    add_gateway_parser(sub)

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
        from stepline.engine.images import VisionUnavailableError

        clear = (
            ModelNotFoundError,
            ValueError,
            FileExistsError,
            FileNotFoundError,
            PermissionError,
            LogInUseError,
            VisionUnavailableError,
        )
        if isinstance(error, clear):
            print(f"stepline: error: {error}", file=sys.stderr)
            if args.command == "serve":  # MLX's threads may run: no interpreter teardown
                from stepline.api.http.serve import end_process

                end_process(2)
            return 2
        raise
