"""Qwen3-Omni's thinker, on `stepline-demo-omni` (a random-weight thinker built offline; the
vision extra): audio and images in one request, each an atomic span under 3-D M-RoPE
positions. Concurrent audio, image and text requests, under small and larger budgets, answer
exactly what mlx-vlm's own generation answers for each alone; a span is never split and runs
past the budget only alone (`stepline replay --verify`); the next turn of a conversation with a
clip encodes nothing again; an image's and a clip's encoder units are priced apart; the
official OpenAI client sends both media in one chat.

mlx-vlm is the reference for what the thinker sees and hears: its `load_audio` decoding of the
file, its processor's expansion of the media tokens (its Whisper features, its Qwen3-VL image
processing), its towers, its language model and its `get_rope_index` positions.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import anyio
import numpy as np
import pytest
from core_driver import make_core, params, sampled
from helpers import collect, open_served, replay
from test_audio import wav

from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.spans import PromptImage
from stepline.api.engine import Engine
from stepline.api.params import SamplingParams
from stepline.engine.audio import AudioData
from stepline.engine.demo_files import OMNI_DEMO
from stepline.engine.images import ImageData
from stepline.events.fold import Status
from stepline.events.log import read_events
from stepline.events.models import Admitted, ChunkPrefilled, ImageEncoded
from stepline.events.replay import verify

pytest.importorskip("mlx_vlm")  # the vision extra
Image = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
RATE = 16_000


def png(seed: int, width: int = 96, height: int = 96) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat(text: str, *, audio: bytes | None = None, image: bytes | None = None) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": text}]
    if audio is not None:
        parts.append({"type": "audio", "audio": audio})
    if image is not None:
        parts.append({"type": "image", "image": image})
    if len(parts) == 1:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """mlx-vlm's own greedy generation of one chat on the demo, alone: (prompt ids, tokens)."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_audio

    from stepline.engine.omni import demo_path

    model, processor = load(str(demo_path()))
    where = tmp_path_factory.mktemp("clips")

    def run(messages: list[dict], max_tokens: int = GREEDY.max_tokens):
        clips, images = [], []
        for m in messages:
            for p in m["content"] if isinstance(m["content"], list) else ():
                if p["type"] == "audio":
                    (where / "clip.wav").write_bytes(p["audio"])
                    clips.append(load_audio(str(where / "clip.wav"), sr=RATE))
                elif p["type"] == "image":
                    images.append(Image.open(io.BytesIO(p["image"])).convert("RGB"))
        shown = [
            {**m, "content": [{"type": p["type"], "text": p.get("text")} for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        text = processor.tokenizer.apply_chat_template(
            shown, add_generation_prompt=True, tokenize=False
        )
        inputs = processor(text=[text], audio=clips or None, images=images or None, padding=True)
        ids = mx.array(inputs["input_ids"])
        rest = {
            k: v
            for k, v in inputs.items()
            if k not in ("input_ids", "attention_mask", "pixel_values")
        }
        tokens = [
            int(t)
            for t, _ in generate_step(
                ids, model, inputs.get("pixel_values"), None, max_tokens=max_tokens,
                temperature=0.0, **rest,
            )
        ]  # fmt: skip
        return np.asarray(ids).reshape(-1).tolist(), tokens

    return run


async def greedy_chat(engine: Engine, messages: list[dict]) -> list:
    return await collect(engine.generate(messages=messages, params=GREEDY))


def token_ids(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


CHATS = [
    chat("What do you hear and see?", audio=wav(5.0), image=png(1)),  # 67 + 38 span tokens
    chat("Describe it in one word.", audio=wav(1.0, 880.0)),
    chat("And this picture?", image=png(2, 64, 96)),
    chat("Tell me about the sea and the sky, at length please."),
]


def test_a_clip_of_any_length_gets_as_many_tokens_as_mlx_vlms_audio_tower_makes_frames():
    import mlx.core as mx
    from mlx_vlm.models.qwen3_omni_moe.audio import _get_feat_extract_output_lengths

    from stepline.engine.omni import audio_tokens

    frames = mx.arange(1, 6001)
    theirs = _get_feat_extract_output_lengths(frames).tolist()
    assert [audio_tokens(n) for n in range(1, 6001)] == theirs


def test_a_clips_features_are_the_whisper_extractors_to_the_bit_for_any_length() -> None:
    from transformers import WhisperFeatureExtractor

    from stepline.engine.omni import demo_path, whole_clip_features

    ours = whole_clip_features(WhisperFeatureExtractor.from_pretrained(demo_path()))
    theirs = WhisperFeatureExtractor.from_pretrained(demo_path())
    assert "_np_extract_fbank_features" in vars(ours)  # its own log-mel, not the loop
    rng = np.random.default_rng(5)
    for num_samples in (160, 12_345, 16_000, 44_321, 160_000):
        clip = (0.2 * rng.standard_normal(num_samples)).astype(np.float32)
        kw = {"sampling_rate": RATE, "padding": True, "truncation": False}
        got = ours(clip, return_attention_mask=True, return_tensors="np", **kw)
        want = theirs(clip, return_attention_mask=True, return_tensors="np", **kw)
        assert np.array_equal(got["input_features"], want["input_features"]), num_samples
        assert np.array_equal(got["attention_mask"], want["attention_mask"])


async def test_a_prompt_with_a_clip_and_an_image_has_mlx_vlms_ids(reference) -> None:
    async with Engine.open(OMNI_DEMO) as engine:
        prepared = engine.prepare(messages=CHATS[0])
    ids, _ = reference(CHATS[0], max_tokens=1)
    assert prepared.ids == ids
    clip, image = prepared.images
    assert clip.medium == "audio" and clip.whole and clip.end - clip.start == 67
    assert image.medium == "image" and image.whole and image.end - image.start == 38


@pytest.mark.parametrize("max_step_tokens", [32, 128])
async def test_concurrent_audio_image_and_text_requests_answer_what_mlx_vlm_answers_each_alone(
    reference, max_step_tokens: int, tmp_path: Path
) -> None:
    # 32: the 5 s clip's span (67 tokens) and the images' (38) fit no step and run alone;
    # 128: they fit, and wait for a step that holds them whole, beside chunks and decode rows.
    log = tmp_path / "events.jsonl"
    async with Engine.open(
        OMNI_DEMO, max_step_tokens=max_step_tokens, max_num_seqs=8, event_log=str(log)
    ) as engine:
        results: list[list] = [[] for _ in CHATS]

        async def run(i: int) -> None:
            results[i] = await greedy_chat(engine, CHATS[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(CHATS)):
                tg.start_soon(run, i)
    for messages, outs in zip(CHATS, results, strict=True):
        assert outs[-1].finish_reason == "length"
        assert token_ids(outs) == reference(messages)[1]
    events = list(read_events(log))
    spans = {e.request_id: e.images for e in events if isinstance(e, Admitted)}
    chunks = [e for e in events if isinstance(e, ChunkPrefilled)]
    for rid, refs in spans.items():
        for ref in refs:  # every span in one chunk, whole
            holding = [c for c in chunks if c.request_id == rid and c.start < ref.end]
            holding = [c for c in holding if ref.start < c.end]
            assert len(holding) == 1 and holding[0].start <= ref.start < ref.end <= holding[0].end
    assert sorted(r.medium for refs in spans.values() for r in refs) == [
        "audio", "audio", "image", "image",
    ]  # fmt: skip
    code, text = replay(str(log), "--verify")  # never split, over budget only alone
    assert code == 0, text


async def test_the_log_records_each_medium_its_encoder_units_and_keeps_both_beside_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    clip, picture = wav(2.0), png(3)
    messages = chat("What is this?", audio=clip, image=picture)
    async with Engine.open(OMNI_DEMO, max_step_tokens=128, event_log=str(log)) as engine:
        outs = await greedy_chat(engine, messages)
    assert outs[-1].finish_reason == "length"
    events = list(read_events(log))
    (admitted,) = [e for e in events if isinstance(e, Admitted)]
    heard, seen = admitted.images
    assert heard.medium == "audio" and heard.seconds == 2.0 and heard.num_samples == 32_000
    # 2 s: 2 windows of the front end, then 2 layers; 26 frames + markers
    assert heard.units == 4 and heard.end - heard.start == 28
    assert seen.medium == "image" and seen.units == 3 and (seen.width, seen.height) == (96, 96)
    encoded = [e for e in events if isinstance(e, ImageEncoded)]
    assert sum(e.end - e.start for e in encoded if e.image == 0) == 4
    assert sum(e.end - e.start for e in encoded if e.image == 1) == 3
    kept = log.with_name(f"{log.name}.images")
    assert (kept / heard.digest).read_bytes() == clip
    assert (kept / seen.digest).read_bytes() == picture
    assert verify(log).ok


async def test_the_next_turn_with_a_clip_recomputes_only_itself_and_encodes_nothing_again(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    first = chat("What is this sound?", audio=wav(3.0), image=png(4))
    async with Engine.open(OMNI_DEMO, max_step_tokens=128, event_log=str(log)) as engine:
        outs = await greedy_chat(engine, first)
        answer = "".join(o.text for o in outs)
        second = [*first, {"role": "assistant", "content": answer}]
        second.append({"role": "user", "content": "Is it louder at the end?"})
        prepared = engine.prepare(messages=second)
        own = len(prepared.ids) - len(engine.prepare(messages=first).ids)  # the new turn's
        outs2 = await greedy_chat(engine, second)
    assert outs2[-1].finish_reason == "length"
    computed = len(prepared.ids) - outs2[-1].num_cached_tokens
    events = list(read_events(log))
    admitted = [e for e in events if isinstance(e, Admitted)]
    second_id = admitted[1].request_id
    assert not [e for e in events if isinstance(e, ImageEncoded) and e.request_id == second_id]
    assert outs2[-1].num_cached_tokens > max(i.end for i in admitted[1].images)
    assert computed <= own + 16


async def test_a_run_with_both_media_is_re_executed_token_for_token_from_what_was_kept(
    tmp_path: Path,
) -> None:
    from stepline.api.reexecute import reexecute

    log = tmp_path / "events.jsonl"
    async with Engine.open(OMNI_DEMO, max_step_tokens=32, event_log=str(log)) as engine:
        async with anyio.create_task_group() as tg:
            for messages in CHATS:
                tg.start_soon(greedy_chat, engine, messages)
    report = await reexecute(log, OMNI_DEMO)
    assert report.ok and report.num_compared == len(CHATS)


def test_stepline_generate_asks_about_an_audio_file_and_an_image_file(
    tmp_path: Path, capsys
) -> None:
    from stepline.api.cli import main

    clip, picture = tmp_path / "tone.wav", tmp_path / "noise.png"
    clip.write_bytes(wav(1.0))
    picture.write_bytes(png(6))
    argv = ["generate", "What is this?", "--audio", str(clip), "--image", str(picture)]
    assert main([*argv, "--model", OMNI_DEMO, "--max-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert "output 6 tokens (length)" in out.err and out.out.strip()


# -- the cost of an encoder unit, per medium (no model: tests/core_driver.py) ----------


def clip_span(start: int, end: int, units: int) -> PromptImage:
    data = b"clip"
    clip = AudioData(data, "c" * 64, "wav", 1.0, RATE, RATE, RATE)
    return PromptImage(start, end, clip, inputs={}, units=units, whole=True, medium="audio")


def image_span(start: int, end: int, units: int) -> PromptImage:
    data = ImageData(b"img", "i" * 64, 8, 8, "image/png", None)
    return PromptImage(start, end, data, inputs={}, units=units, whole=True)


def test_a_steps_encoder_units_are_priced_by_their_medium():
    # an image's block costs 20 ms, a clip's layer 2 ms: beside 2 decode rows a step holds
    # one image unit, or many audio units
    cost = StepCost(
        step=0.004, per_chunk=0.002, per_prefill_token=0.0002, per_decode_row=0.002,
        per_encode_unit=0.02, per_audio_unit=0.002,
    )  # fmt: skip
    config = SchedulerConfig(max_step_tokens=512, max_num_seqs=8, max_step_ms=100)
    core = make_core(config=config, cost=cost)
    for i in range(2):
        core.add(f"d{i}", range(8), params(10_000))
    while any(s.status is not Status.DECODING for s in core.states.values()):
        work = core.schedule()
        assert work is not None
        core.update_from_output(work, sampled(work))
    core.add("omni", range(100), params(1), images=[clip_span(2, 30, 16), image_span(40, 60, 6)])
    plans = []
    while "omni" in core.states:
        work = core.schedule()
        assert work is not None
        core.update_from_output(work, sampled(work))
        plans.append(work.plan)
    audio = [e.num_units for p in plans for e in p.encodes if e.image == 0]
    image = [e.num_units for p in plans for e in p.encodes if e.image == 1]
    assert sum(audio) == 16 and sum(image) == 6
    assert max(audio) >= 4 * max(image), (audio, image)  # each priced as its own tower's
    for p in plans:
        assert p.features.audio_units == sum(e.num_units for e in p.encodes if e.image == 0)
        assert p.features.encode_units == sum(e.num_units for e in p.encodes if e.image == 1)
        assert p.predicted_seconds is not None and p.predicted_seconds <= 0.1


def test_the_warm_up_measures_the_image_and_the_audio_encoder_apart() -> None:
    from stepline.actors.scheduler.warmup import Warmup
    from stepline.engine.models import load_model
    from stepline.engine.runner import ModelRunner

    loaded = load_model(OMNI_DEMO)
    runner = ModelRunner(loaded)
    warmup = Warmup(runner, SchedulerConfig(max_step_tokens=128), 1000, loaded.max_context)
    warmup.run()
    assert warmup.done and not warmup.failed
    assert runner.num_sequences == 0
    images = [s for s in warmup.samples if s.features.encode_units]
    clips = [s for s in warmup.samples if s.features.audio_units]
    assert images and clips and not [s for s in images if s.features.audio_units]


# -- over HTTP, with the official client ------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_openai_chat_and_responses_take_a_clip_and_an_image_in_one_message() -> None:
    clip, picture = wav(2.0), png(5)
    messages = chat("What do you hear and see?", audio=clip, image=picture)
    async with open_served(OMNI_DEMO) as served:
        engine = served.engine
        prepared = engine.prepare(messages=messages)
        want = ""
        async for out in engine.generate(
            messages=messages, params=SamplingParams(max_tokens=8, temperature=0.0)
        ):
            want += out.text
        assert want
        image_url = f"data:image/png;base64,{b64(picture)}"
        audio = {"data": b64(clip), "format": "wav"}
        async with served.client() as client:
            answer = await client.chat.completions.create(
                model=OMNI_DEMO,
                max_tokens=8,
                temperature=0.0,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What do you hear and see?"},
                            {"type": "input_audio", "input_audio": audio},
                            {"type": "image_url", "image_url": {"url": image_url}},
                        ],
                    }
                ],
            )  # fmt: skip
            assert answer.choices[0].message.content == want
            assert answer.usage is not None and answer.usage.prompt_tokens == len(prepared.ids)
            response = await client.responses.create(
                model=OMNI_DEMO,
                max_output_tokens=8,
                temperature=0.0,
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What do you hear and see?"},
                            {"type": "input_audio", "input_audio": audio},  # type: ignore[list-item,misc]
                            {"type": "input_image", "image_url": image_url, "detail": "auto"},
                        ],
                    }
                ],
            )  # fmt: skip
            assert response.output_text == want
