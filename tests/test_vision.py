"""Images in the same scheduler, on `stepline-demo-vision` (a random-weight Idefics3, the
family of SmolVLM; the vision extra, which the test install brings): concurrent image
requests, chunked under a small budget and batched with text requests, answer exactly what
mlx-vlm's own generation answers for each alone; the log records every image and no chunk
ends inside one; the prefix cache tells images apart by their content."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import anyio
import numpy as np
import pytest
from helpers import collect
from PIL import Image

from stepline.api.engine import Engine
from stepline.api.params import SamplingParams
from stepline.engine.images import ImageError
from stepline.engine.models import VISION_DEMO
from stepline.events.log import read_events
from stepline.events.models import Admitted, ChunkPrefilled, ImageEncoded
from stepline.events.replay import timeline, verify

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def png(seed: int, width: int = 150, height: int = 100) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat(text: str, image: bytes | None = None) -> list[dict]:
    if image is None:
        return [{"role": "user", "content": text}]
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image", "image": image}],
        }
    ]


@pytest.fixture(scope="module")
def reference():
    """mlx-vlm's own greedy generation of one chat on the demo, alone: its token ids."""
    from mlx_vlm import generate, load

    from stepline.engine.vision.demos import demo_path

    model, processor = load(str(demo_path()))

    def run(messages: list[dict], max_tokens: int = 10) -> list[int]:
        images = [
            Image.open(io.BytesIO(p["image"])).convert("RGB")
            for m in messages
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image"
        ]
        shown = [
            {**m, "content": [{"type": p["type"], "text": p.get("text")} for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        prompt = processor.tokenizer.apply_chat_template(
            shown, add_generation_prompt=True, tokenize=False
        )
        out = generate(
            model,
            processor,
            prompt,
            image=images or None,
            max_tokens=max_tokens,
            temperature=0.0,
            verbose=False,
        )
        return list(out.token_ids)

    return run


async def greedy_chat(engine: Engine, messages: list[dict], **params: object) -> list:
    """The outputs of a greedy chat of `messages` (`params` over GREEDY's)."""
    sampling = GREEDY.model_copy(update=params)
    return await collect(engine.generate(messages=messages, params=sampling))


def token_ids(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("max_step_tokens", [32, 128])
async def test_concurrent_image_and_text_requests_answer_what_mlx_vlm_answers_each_alone(
    reference, max_step_tokens: int
) -> None:
    # 32: the larger images' spans (94 tokens) fit no step and run alone; 128: spans fit, and
    # chunks of text and images share steps with decode rows.
    chats = [
        chat("What is in this picture?", png(0)),
        chat("Describe it in one word.", png(1, 60, 60)),
        chat("Tell me about the sea and the sky, at length please."),
        chat("And this one, what is it?", png(0)),
    ]
    async with Engine.open(VISION_DEMO, max_step_tokens=max_step_tokens, max_num_seqs=8) as engine:
        results: list[list] = [[] for _ in chats]

        async def run(i: int) -> None:
            results[i] = await greedy_chat(engine, chats[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(chats)):
                tg.start_soon(run, i)
    for messages, outs in zip(chats, results, strict=True):
        assert outs[-1].finish_reason == "length"
        assert token_ids(outs) == reference(messages)


async def test_the_log_records_each_image_its_encoder_steps_and_the_chunks_that_hold_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    image = png(2, 120, 90)
    # The tokens-only policy runs an image's encoder whole in one step; with a cost model that
    # prices it, in as many units as the time allows (tests/test_image_scheduling.py).
    async with Engine.open(
        VISION_DEMO, max_step_tokens=48, max_num_seqs=4, event_log=str(log), max_step_ms=None
    ) as engine:
        prepared = engine.prepare(messages=chat("What is this?", image))
        outs = await greedy_chat(engine, chat("What is this?", image))
        text_outs = await greedy_chat(engine, chat("No image here."))
    assert outs[-1].finish_reason == text_outs[-1].finish_reason == "length"
    events = list(read_events(log))
    admitted = [e for e in events if isinstance(e, Admitted)]
    (ref,) = admitted[0].images
    span = prepared.images[0]
    assert ref.digest == hashlib.sha256(image).hexdigest()
    assert (ref.start, ref.end) == (span.start, span.end) and ref.end - ref.start > 48
    assert (ref.width, ref.height, ref.num_bytes) == (120, 90, len(image))
    assert ref.units == 5 * 2 and not ref.whole  # 2 x 2 tiles and the global view, 2 layers
    assert admitted[1].images == ()
    rid = admitted[0].request_id
    encoded = [e for e in events if isinstance(e, ImageEncoded)]
    assert [(e.request_id, e.image, e.start, e.end) for e in encoded] == [(rid, 0, 0, 10)]
    chunks = [e for e in events if isinstance(e, ChunkPrefilled) and e.request_id == rid]
    marked = [c for c in chunks if c.images]
    assert [c.images for c in marked] == [(ref.digest,)] * len(marked)
    assert marked[0].start == ref.start and marked[-1].end >= ref.end
    assert all(c.seq > encoded[0].seq for c in marked)  # the encoder first
    assert max(c.end - c.start for c in chunks) <= 48  # a span chunked as text, in budget
    assert verify(log).ok
    # Replay's picture and summary name the encoder's steps.
    steps = timeline.collect(log).steps.values()
    (encoder,) = [s for s in steps if s.encodes]
    assert encoder.encodes == (rid,) and f"{rid} image encoder" in encoder.describe()


async def test_a_different_image_shares_no_cache_and_the_same_image_next_turn_is_a_hit(
    reference,
) -> None:
    first = chat("What is in this picture?", png(3))
    async with Engine.open(VISION_DEMO, max_step_tokens=256, max_num_seqs=4) as engine:
        span = engine.prepare(messages=first).images[0]
        answer = await greedy_chat(engine, first)
        # Same text, another image: the cache serves the text before the image, not the span.
        other = await greedy_chat(engine, chat("What is in this picture?", png(4)))
        assert 0 < other[-1].num_cached_tokens <= span.start
        assert token_ids(other) == reference(chat("What is in this picture?", png(4)))
        # The next turn of the first chat: its image is not computed again.
        turn = [
            *first,
            {"role": "assistant", "content": "".join(o.text for o in answer)},
            {"role": "user", "content": "Say more."},
        ]
        more = await greedy_chat(engine, turn)
        assert more[-1].num_cached_tokens >= span.end
        assert token_ids(more) == reference(turn)


async def test_an_image_sent_to_a_text_model_or_bytes_that_are_no_image_are_refused() -> None:
    async with Engine.open(VISION_DEMO, max_step_tokens=64) as engine:
        with pytest.raises(ImageError, match="not an image"):
            await engine.submit(messages=chat("What is this?", b"\x89PNG\r\n\x1a\n broken"))
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        assert not engine.accepts_images
        with pytest.raises(ImageError, match="reads text only") as err:
            await engine.submit(messages=chat("What is this?", png(0)))
        assert err.value.code == "unsupported_content_type"


def test_the_warm_up_of_a_vision_model_prices_its_encoder() -> None:
    from stepline.actors.scheduler.cost_model import fit
    from stepline.actors.scheduler.plan import SchedulerConfig
    from stepline.actors.scheduler.warmup import Warmup
    from stepline.engine.models import load_model
    from stepline.engine.runner import ModelRunner

    loaded = load_model(VISION_DEMO)
    runner = ModelRunner(loaded)
    warmup = Warmup(runner, SchedulerConfig(max_step_tokens=128), 1000, loaded.max_context)
    warmup.run()
    assert runner.num_sequences == 0  # it frees what it admitted
    encoded = [s for s in warmup.samples if s.features.encode_units]
    assert len(encoded) >= 2 and all(s.features.decode_rows >= 1 for s in encoded)
    assert fit(warmup.samples).per_encode_unit > 0


def test_a_warm_up_episode_that_fails_is_skipped_and_the_engine_serves_on(monkeypatch) -> None:
    from stepline.actors.scheduler.plan import SchedulerConfig
    from stepline.actors.scheduler.warmup import Warmup
    from stepline.engine.models import load_model
    from stepline.engine.runner import ModelRunner

    loaded = load_model(VISION_DEMO)
    runner = ModelRunner(loaded)
    warmup = Warmup(runner, SchedulerConfig(max_step_tokens=128), 1000, loaded.max_context)

    def no_image(*args, **kwargs):
        raise OSError("cannot identify image file")

    monkeypatch.setattr(warmup, "_image_prompt", no_image)
    warmup.run()
    assert warmup.done and warmup.failed == ["OSError('cannot identify image file')"]
    assert runner.num_sequences == 0  # what the failed episode admitted was freed
    assert warmup.samples and not any(s.features.encode_units for s in warmup.samples)


async def test_a_run_with_images_is_re_executed_token_for_token_from_the_images_kept(
    tmp_path: Path,
) -> None:
    import shutil

    from stepline.api.reexecute import reexecute
    from stepline.events.image_files import images_dir
    from stepline.events.replay.reexecute import load_recorded_run, plan_reexecution

    log = tmp_path / "events.jsonl"
    chats = [
        chat("What is in this picture?", png(5)),
        chat("Describe it.", png(6, 60, 60)),
        chat("Just text."),
    ]
    async with Engine.open(
        VISION_DEMO, max_step_tokens=48, max_num_seqs=4, event_log=str(log)
    ) as engine:
        async with anyio.create_task_group() as tg:
            for messages in chats:
                tg.start_soon(greedy_chat, engine, messages)
    kept = sorted(p.name for p in images_dir(log).iterdir())
    assert kept == sorted(
        hashlib.sha256(png(s, *wh)).hexdigest() for s, wh in ((5, ()), (6, (60, 60)))
    )
    report = await reexecute(log, VISION_DEMO)
    assert report.ok and report.num_compared == 3
    # Without the images beside the log, their requests are said to be skipped up front.
    shutil.rmtree(images_dir(log))
    plan = plan_reexecution(load_recorded_run(log))
    assert plan.num_comparable == 1
    assert plan.skipped == {"its images were not kept beside the log": 2}


def test_stepline_generate_asks_about_an_image_file(tmp_path: Path, capsys) -> None:
    from stepline.api.cli import main

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(7))
    argv = ["generate", "What is this?", "--image", str(picture), "--model", VISION_DEMO]
    assert main([*argv, "--max-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert "output 6 tokens (length)" in out.err and out.out.strip()
    assert main(["generate", "hi", "--image", str(tmp_path / "gone.png")]) == 2
    assert "No such file" in capsys.readouterr().err


async def test_a_quantized_checkpoint_kept_quantized_answers_what_mlx_vlm_answers(
    tmp_path: Path,
) -> None:
    # On a GPU a quantized checkpoint is served as stored (--dtype auto); here, --dtype keep.
    from mlx_vlm import generate, load
    from mlx_vlm.convert import convert

    from stepline.engine.vision.demos import demo_path

    path = tmp_path / "demo-4bit"
    convert(str(demo_path()), mlx_path=str(path), quantize=True, q_bits=4, q_group_size=32)
    messages = chat("What is in this picture?", png(8))
    async with Engine.open(str(path), dtype="keep", max_step_tokens=64) as engine:
        assert "4-bit quantized" in engine.step_loop.runner.loaded.weights
        mine = token_ids(await greedy_chat(engine, messages))
    model, processor = load(str(path))
    prompt = processor.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image"},
                ],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    image = Image.open(io.BytesIO(png(8))).convert("RGB")
    out = generate(
        model, processor, prompt, image=[image], max_tokens=10, temperature=0.0, verbose=False
    )
    assert mine == list(out.token_ids)
