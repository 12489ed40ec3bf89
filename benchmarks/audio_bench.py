"""Audio in the scheduler: what an audio request costs the streams beside it, its time to first
token against mlx-vlm's own, and what the next turn of its chat recomputes.

    .venv/bin/python benchmarks/audio_bench.py [--model phi4mm-audio-shape] [--repeats 3]
        [--seconds 10] [--streams 4] [--max-step-ms 100] [--stall-only] [--event-log PATH]

--model: `phi4mm-audio-shape` (default) builds, once, a random-weight Phi-4-multimodal with
Phi-4-multimodal-instruct's audio encoder (its Conformer: 24 blocks of width 1024, 16 heads,
8-fold subsampling: a 10 s clip is 125 tokens) and a text model of SmolLM2-135M's size in
Phi-3's layout (30 layers of width 576), with the demo tokenizer: real encoder costs, a text
model whose weights matter, no download; or any model stepline serves (`stepline-demo-audio`,
`stepline-demo-omni`, a directory).

An omni model (`stepline-demo-omni`, a Qwen3-Omni thinker): the request holds the clip and an
image (--image-size pixels), each an atomic span; the text prompt it is compared with has the
same token count; mlx-vlm's side is its `stream_generate` on the same chat (its processor,
towers and prefill), to the first token.

--chunked-span: the span chunked as text once encoded (exact for Phi-4, whose text model
attends to audio tokens causally), instead of one atomic chunk (the default, as an omni
thinker's sentinel-wrapped span must be): what atomicity costs the streams.

Sections, each repeated --repeats times (medians; the ratios inside one run):
1. **stall**: --streams greedy chats decoding; then one request arrives: a clip of --seconds
   (a tone) with a question, or a text prompt of the same token count (alternating). The
   streams' longest gap between two tokens while it prefills, and its time to first token.
   Target: audio / text <= 1.5 (the encoder is priced, its units spread over steps).
2. **ttft**: the audio request alone on an idle, warmed-up engine, from `generate` to its
   first token, against mlx-vlm's `generate_step` on the same checkpoint and prompt ids (its
   feature extractor, Conformer and projection included, as stepline's; mlx-vlm's processor
   hard-codes Phi-4's audio token id, which the demo vocabulary does not hold, so the ids are
   expanded as the processor does). Target: <= 1.1.
3. **next turn**: the chat again with the answer and a new question: prompt tokens computed
   (prompt - cached) against the new turn's own tokens, and whether the clip was encoded
   again. Target: computed <= new + 16, no encoder unit.

A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
import wave
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stepline.engine  # noqa: E402,F401  (OpenBLAS before MLX)
from benchmarks.vision_bench import first_token, picture, stall  # noqa: E402
from stepline.api import Engine, SamplingParams  # noqa: E402

SHAPE = "phi4mm-audio-shape"
PHI4MM_AUDIO = {
    "text": {  # SmolLM2-135M's size, Phi-3's names (fused qkv, partial rotary as Phi-4's)
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "max_position_embeddings": 8192,
        "original_max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "vision": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "patch_size": 14,
        "image_size": 56,
    },
    "audio": {  # microsoft/Phi-4-multimodal-instruct's audio_processor config
        "attention_dim": 1024,
        "attention_heads": 16,
        "num_blocks": 24,
        "linear_units": 1536,
        "input_size": 80,
        "time_reduction": 8,
        "ext_pw_out_channel": 1024,
        "depthwise_seperable_out_channel": 1024,
        "conv_channels": 1024,
    },
    "seed": 13,
    "init_std": 0.02,
}
QUESTION = "What is said in this clip? Transcribe it."


def model_path(name: str) -> str:
    from stepline.engine.models import AUDIO_DEMO, OMNI_DEMO

    if name == AUDIO_DEMO:
        from stepline.engine.audio_model import demo_path

        return str(demo_path())
    if name == OMNI_DEMO:
        from stepline.engine.omni import demo_path as omni_demo_path

        return str(omni_demo_path())
    if name != SHAPE:
        return name
    from stepline.engine.audio_model import build_phi4mm
    from stepline.engine.cache_dirs import build_once, cache_root

    path = cache_root(None) / "models" / f"{SHAPE}-1"
    build_once(path, lambda out: build_phi4mm(out, PHI4MM_AUDIO))
    return str(path)


def tone(seconds: float, seed: int, rate: int = 16_000) -> bytes:
    """A WAV of a tone whose pitch depends on `seed` (a new clip: no cache hit)."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * (220 + 7 * seed) * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def audio_chat(clip: bytes, question: str = QUESTION, image: bytes | None = None) -> list[dict]:
    parts = [{"type": "audio", "audio": clip}, {"type": "text", "text": question}]
    if image is not None:  # an omni model's request: the clip and an image
        parts.insert(1, {"type": "image", "image": image})
    return [{"role": "user", "content": parts}]


def is_omni(path: str) -> bool:
    import json

    from stepline.engine.omni import is_omni as omni_config

    return omni_config(json.loads((Path(path) / "config.json").read_text()))


def mlx_vlm_omni_ttft(path: str, messages: list[dict]) -> float:
    """mlx-vlm's `stream_generate` to its first token on an omni chat (the clip and the
    image as files: its decoding, processor, towers and prefill included)."""
    import tempfile

    from mlx_vlm import load, stream_generate

    model, processor = load(path)
    parts = messages[0]["content"]
    shown = [
        {**messages[0], "content": [{"type": p["type"], "text": p.get("text")} for p in parts]}
    ]
    prompt = processor.tokenizer.apply_chat_template(
        shown, add_generation_prompt=True, tokenize=False
    )
    times = []
    with tempfile.TemporaryDirectory() as where:
        clip, image = Path(where) / "clip.wav", Path(where) / "image.png"
        clip.write_bytes(next(p["audio"] for p in parts if p["type"] == "audio"))
        image.write_bytes(next(p["image"] for p in parts if p["type"] == "image"))
        for _ in range(3):  # the first call builds; the others are timed
            t0 = time.perf_counter()
            for _ in stream_generate(
                model, processor, prompt, image=[str(image)], audio=[str(clip)], max_tokens=1,
                temperature=0.0,
            ):  # fmt: skip
                break
            times.append(time.perf_counter() - t0)
    return min(times[1:])


def mlx_vlm_ttft(path: str, ids: list[int], clip: bytes) -> float:
    """mlx-vlm's time to first token on prompt `ids` holding `clip`'s span (expanded): its
    decoding of the file, its features, encoder and prefill."""
    import tempfile

    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_audio

    model, processor = load(path)
    times = []
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        f.write(clip)
        f.flush()
        for _ in range(2):  # the first call builds; the second is timed
            t0 = time.perf_counter()
            features = processor.audio_processor([(load_audio(f.name, sr=16_000), 16_000)])
            for _ in generate_step(mx.array([ids]), model, None, None, max_tokens=1, **features):
                break
            times.append(time.perf_counter() - t0)
    return times[-1]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SHAPE)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-step-ms", type=float, default=100.0)
    p.add_argument("--stall-only", action="store_true", help="section 1 alone")
    p.add_argument("--event-log", help="write the engine's event log here (`stepline replay`)")
    p.add_argument("--image-size", type=int, default=96, help="an omni model's image (pixels)")
    p.add_argument(
        "--chunked-span",
        action="store_true",
        help="chunk the clip's span as text once encoded (Phi-4 allows it: causal, 1-D), "
        "instead of one atomic chunk",
    )
    args = p.parse_args()
    if args.chunked_span:
        from stepline.engine.audio_model import Phi4mmAudio

        Phi4mmAudio.atomic = False
    path = model_path(args.model)
    omni = is_omni(path)
    size = (args.image_size, args.image_size)

    def chat_of(clip: bytes, seed: int, question: str = QUESTION) -> list[dict]:
        return audio_chat(clip, question, picture(size, seed) if omni else None)

    what = f"a {args.seconds:g} s clip" + (f" and a {size[0]}x{size[1]} image" if omni else "")
    print(f"model {args.model} ({path}), {what}, {args.streams} streams")

    logged = {"event_log": args.event_log} if args.event_log else {}
    async with Engine.open(path, max_step_ms=args.max_step_ms, **logged) as engine:
        loop = engine.step_loop
        await loop.wait_until(lambda: loop.settled)  # the warm-up: the encoder priced too
        clip = tone(args.seconds, 0)
        prepared = engine.prepare(messages=chat_of(clip, 0))
        span = prepared.images[0]
        n = len(prepared.ids)
        for s in prepared.images:
            print(
                f"prompt {n} tokens, the {s.medium} span {s.end - s.start} tokens "
                f"({'one atomic chunk' if s.whole else 'chunked as text'}), its encoder "
                f"{s.units} units"
            )
        cost = loop.cost_model.cost if loop.cost_model is not None else None
        if cost is not None:
            print(
                f"priced: {cost.per_audio_unit * 1e3:.1f} ms an audio encoder unit, "
                f"{cost.per_encode_unit * 1e3:.1f} ms an image encoder unit"
            )

        ratios, audio_stalls, text_stalls = [], [], []
        for r in range(args.repeats):
            top = min(engine.vocab_size, 20000) - 20  # past the special tokens
            text_ids = [20 + (7 * i + r) % top for i in range(n)]
            greedy = SamplingParams(max_tokens=1, temperature=0.0)
            probe = {"messages": chat_of(tone(args.seconds, 100 + r), 100 + r), "params": greedy}
            a_stall, a_ttft = await stall(engine, probe, args.streams)
            t_stall, _ = await stall(engine, {"prompt": text_ids, "params": greedy}, args.streams)
            audio_stalls.append(a_stall)
            text_stalls.append(t_stall)
            ratios.append(a_stall / t_stall)
            print(
                f"  stall {r + 1}: audio {a_stall * 1e3:.0f} ms, text of {n} tokens "
                f"{t_stall * 1e3:.0f} ms: {a_stall / t_stall:.2f}x "
                f"(audio TTFT beside them {a_ttft:.2f} s)"
            )
        print(
            f"stall: audio {statistics.median(audio_stalls) * 1e3:.0f} ms, text "
            f"{statistics.median(text_stalls) * 1e3:.0f} ms, median ratio "
            f"{statistics.median(ratios):.2f}x (target <= 1.5)"
        )
        if args.stall_only:
            return
        alone = []
        for r in range(2):
            ttft, _ = await first_token(
                engine,
                messages=chat_of(tone(args.seconds, 200 + r), 200 + r),
                params=SamplingParams(max_tokens=1, temperature=0.0),
            )
            alone.append(ttft)
        stepline_ttft = statistics.median(alone)
        reference_clip = tone(args.seconds, 300)
        reference_chat = chat_of(reference_clip, 300)
        reference_ids = engine.prepare(messages=reference_chat).ids

        chat = chat_of(clip, 0)
        _, outs = await first_token(
            engine, messages=chat, params=SamplingParams(max_tokens=24, temperature=0.0)
        )
        answer = "".join(o.text for o in outs)
        turn = [
            *chat,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And who is speaking?"},
        ]
        new = len(engine.prepare(messages=turn).ids)
        _, outs = await first_token(
            engine, messages=turn, params=SamplingParams(max_tokens=1, temperature=0.0)
        )
        last = outs[-1]
        computed = last.num_prompt_tokens - last.num_cached_tokens
        first_turn = len(engine.prepare(messages=chat).ids)
    if omni:
        reference = mlx_vlm_omni_ttft(path, reference_chat)
    else:
        reference = mlx_vlm_ttft(path, reference_ids, reference_clip)
    print(
        f"ttft alone: stepline {stepline_ttft:.3f} s, mlx-vlm {reference:.3f} s: "
        f"{stepline_ttft / reference:.2f}x (target <= 1.1)"
    )
    print(
        f"next turn: {new} prompt tokens, {last.num_cached_tokens} cached, {computed} computed; "
        f"the first turn's prompt (the clip's span in it) {first_turn}, the new turn's own "
        f"tokens {new - first_turn} (target: computed <= {new - first_turn + 16}; the clip's "
        f"span lies {'inside' if last.num_cached_tokens >= span.end else 'OUTSIDE'} the cached "
        "prefix, so it is not encoded again)"
    )


if __name__ == "__main__":
    asyncio.run(main())
