"""Images in the scheduler: what an image request costs the streams beside it, its time to
first token against mlx-vlm's own, and what the next turn of its chat recomputes.

    .venv/bin/python benchmarks/vision_bench.py [--model smolvlm-256m-shape] [--repeats 3]
        [--image 1024x768] [--streams 4] [--max-step-ms 100] [--stall-only] [--event-log PATH]

--model: `smolvlm-256m-shape` (default) builds, once, a random-weight checkpoint of
SmolVLM-256M-Instruct's shape (its SigLIP encoder of 12 layers at 512-pixel tiles, 64 tokens
a tile; SmolLM2-135M's text model and tokenizer, from the default model's GGUF): real sizes,
so real costs, with no download from the model hub; or any model stepline serves
(`stepline-demo-vision`, `stepline-demo-vision-qwen`: a Qwen2.5-VL whose image positions are
3-D M-RoPE, tiny, so its costs are not a real model's; a directory).

Sections, each repeated --repeats times (medians; the ratios inside one run):
1. **stall**: --streams greedy chats decoding; then one request arrives: an image (random
   pixels of --image size) with a question, or a text prompt of the same token count
   (alternating). The streams' longest gap between two tokens while it prefills, and its
   time to first token. Target: image / text <= 1.5 (the encoder is priced).
2. **ttft**: the image request alone on an idle, warmed-up engine, from `generate` to its
   first token, against mlx-vlm's `stream_generate` on the same checkpoint (its processor
   and encoder included, as stepline's). Target: <= 1.1.
3. **next turn**: the chat again with the answer and a new question: prompt tokens computed
   (prompt - cached) against the new turn's own tokens (everything after the first turn's
   prompt: the answer as the template renders it, the new question). Target: <= new + 16.

A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stepline.engine  # noqa: E402,F401  (OpenBLAS before MLX)
from stepline.api import Engine, SamplingParams  # noqa: E402

SHAPE = "smolvlm-256m-shape"
# SmolVLM-256M-Instruct's config (Hugging Face, HuggingFaceTB/SmolVLM-256M-Instruct).
SMOLVLM_256M = {
    "text": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "vision": {
        "model_type": "idefics3",
        "hidden_size": 768,
        "num_attention_heads": 12,
        "patch_size": 16,
        "num_hidden_layers": 12,
        "intermediate_size": 3072,
        "image_size": 512,
    },
    "scale_factor": 4,
    "image_seq_len": 64,
    "longest_edge": 2048,
    "seed": 11,
    "init_std": 0.02,
}
QUESTION = "What is in this picture? Describe it."


def model_path(name: str) -> str:
    from stepline.engine.demo_files import VISION_DEMOS

    if name in VISION_DEMOS:
        from stepline.engine.vision.demos import demo_path

        return str(demo_path(name=name))
    if name != SHAPE:
        return name
    from stepline.engine.cache_dirs import build_once, cache_root
    from stepline.engine.default_model import default_gguf
    from stepline.engine.models import _gguf_dir
    from stepline.engine.vision.idefics3 import build_idefics3

    text = _gguf_dir(default_gguf(cache_root(None)))
    path = cache_root(None) / "models" / f"{SHAPE}-1"
    build_once(path, lambda out: build_idefics3(out, SMOLVLM_256M, tokenizer_from=text))
    return str(path)


def picture(size: tuple[int, int], seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_chat(image: bytes, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


async def first_token(engine: Engine, **request) -> tuple[float, list]:
    t0 = time.perf_counter()
    ttft = None
    outs = []
    async for out in engine.generate(**request):
        if out.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        outs.append(out)
    assert ttft is not None
    return ttft, outs


async def stall(engine: Engine, probe: dict, streams: int) -> tuple[float, float]:
    """The streams' longest gap while `probe` prefills, and the probe's time to first token."""
    times: list[list[float]] = [[] for _ in range(streams)]
    started = asyncio.Event()
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        messages = [{"role": "user", "content": f"Tell me story number {i}, at length."}]
        gen = engine.generate(messages=messages, params=params)
        async for out in gen:
            if out.token_ids:
                times[i].append(time.perf_counter())
            if all(len(t) >= 8 for t in times):
                started.set()
            if stop.is_set():
                break
        await gen.aclose()

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    await started.wait()
    t0 = time.perf_counter()
    ttft, _ = await first_token(engine, **probe)
    t1 = t0 + ttft
    await asyncio.sleep(0.3)  # the gaps around the first token
    stop.set()
    await asyncio.gather(*tasks)
    gaps = []
    for t in times:
        inside = [b - a for a, b in zip(t, t[1:], strict=False) if b > t0 and a < t1]
        gaps.append(max(inside, default=0.0))
    return max(gaps), ttft


def mlx_vlm_ttft(path: str, image: bytes) -> float:
    from mlx_vlm import load, stream_generate
    from PIL import Image

    model, processor = load(path)
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": parts}]
    prompt = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    best = []
    for _ in range(2):  # the first call builds; the second is timed
        t0 = time.perf_counter()
        img = Image.open(io.BytesIO(image)).convert("RGB")
        for _ in stream_generate(model, processor, prompt, image=[img], max_tokens=1):
            break
        best.append(time.perf_counter() - t0)
    return statistics.median(best[1:])


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SHAPE)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--image", default="1024x768")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-step-ms", type=float, default=100.0)
    p.add_argument("--stall-only", action="store_true", help="section 1 alone")
    p.add_argument("--event-log", help="write the engine's event log here (`stepline replay`)")
    args = p.parse_args()
    size = tuple(int(x) for x in args.image.split("x"))
    path = model_path(args.model)
    print(f"model {args.model} ({path}), image {args.image}, {args.streams} streams")

    logged = {"event_log": args.event_log} if args.event_log else {}
    async with Engine.open(path, max_step_ms=args.max_step_ms, **logged) as engine:
        loop = engine.step_loop
        await loop.wait_until(lambda: loop.settled)  # the warm-up: the encoder priced too
        image = picture(size, 0)
        prepared = engine.prepare(messages=image_chat(image))
        span = prepared.images[0]
        n = len(prepared.ids)
        print(
            f"prompt {n} tokens, the image's span {span.end - span.start} tokens, its encoder "
            f"{span.units} units"
        )
        cost = loop.cost_model.cost if loop.cost_model is not None else None
        if cost is not None:
            print(f"priced: {cost.per_encode_unit * 1e3:.1f} ms an encoder unit")

        ratios, image_stalls, text_stalls, image_ttfts = [], [], [], []
        for r in range(args.repeats):
            pic = picture(size, 100 + r)  # a new image each time: no cache hit
            top = min(engine.vocab_size, 20000) - 20  # past the special tokens
            text_ids = [20 + (7 * i + r) % top for i in range(n)]
            greedy = SamplingParams(max_tokens=1, temperature=0.0)
            img_stall, img_ttft = await stall(
                engine, {"messages": image_chat(pic), "params": greedy}, args.streams
            )
            txt_stall, _ = await stall(engine, {"prompt": text_ids, "params": greedy}, args.streams)
            image_stalls.append(img_stall)
            text_stalls.append(txt_stall)
            image_ttfts.append(img_ttft)
            ratios.append(img_stall / txt_stall)
            print(
                f"  stall {r + 1}: image {img_stall * 1e3:.0f} ms, text of {n} tokens "
                f"{txt_stall * 1e3:.0f} ms: {img_stall / txt_stall:.2f}x "
                f"(image TTFT beside them {img_ttft:.2f} s)"
            )
        print(
            f"stall: image {statistics.median(image_stalls) * 1e3:.0f} ms, text "
            f"{statistics.median(text_stalls) * 1e3:.0f} ms, median ratio "
            f"{statistics.median(ratios):.2f}x (target <= 1.5)"
        )

        if args.stall_only:
            return
        alone = []
        for r in range(2):  # the encoder ran in the stall section: nothing left to build
            pic = picture(size, 200 + r)
            ttft, _ = await first_token(
                engine,
                messages=image_chat(pic),
                params=SamplingParams(max_tokens=1, temperature=0.0),
            )
            alone.append(ttft)
        stepline_ttft = statistics.median(alone)

        chat = image_chat(image)
        _, outs = await first_token(
            engine, messages=chat, params=SamplingParams(max_tokens=24, temperature=0.0)
        )
        answer = "".join(o.text for o in outs)
        turn = [
            *chat,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And what colour is it mostly?"},
        ]
        new = len(engine.prepare(messages=turn).ids)
        _, outs = await first_token(
            engine, messages=turn, params=SamplingParams(max_tokens=1, temperature=0.0)
        )
        last = outs[-1]
        computed = last.num_prompt_tokens - last.num_cached_tokens
        first_turn = len(engine.prepare(messages=chat).ids)
    reference = mlx_vlm_ttft(path, picture(size, 300))
    print(
        f"ttft alone: stepline {stepline_ttft:.3f} s, mlx-vlm {reference:.3f} s: "
        f"{stepline_ttft / reference:.2f}x (target <= 1.1)"
    )
    print(
        f"next turn: {new} prompt tokens, {last.num_cached_tokens} cached, {computed} computed; "
        f"the first turn's prompt (its image's span in it) {first_turn}, the new turn's own "
        f"tokens (the answer as the template shows it, the new question) {new - first_turn} "
        f"(target: computed <= {new - first_turn + 16})"
    )


if __name__ == "__main__":
    asyncio.run(main())
