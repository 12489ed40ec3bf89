"""Qwen2.5-VL with images, on `stepline-demo-vision-qwen` (a random-weight Qwen2.5-VL built
offline), and Qwen3-VL, on a tiny one (`vision_checkpoints.tiny_qwen3_vl`): their tokens take
3-D M-RoPE positions (an image's from its grid, the text after it from a delta of its own),
and requests of different deltas decode in one batch, in fused steps, chunked under small
budgets and from the prefix cache, each answering exactly what mlx-vlm's own generation
answers for it alone."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import numpy as np
import pytest
from helpers import collect, open_served, submit_together
from vision_checkpoints import tiny_qwen3_vl

from stepline.api.engine import Engine
from stepline.api.params import SamplingParams
from stepline.engine.demo_files import VISION_QWEN_DEMO
from stepline.events.log import read_events
from stepline.events.models import Admitted, ImageEncoded

pytest.importorskip("mlx_vlm")  # the vision extra
Image = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def png(seed: int, width: int = 96, height: int = 96) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat(text: str, image: bytes | None = None, *, image_first: bool = False) -> list[dict]:
    if image is None:
        return [{"role": "user", "content": text}]
    parts = [{"type": "text", "text": text}, {"type": "image", "image": image}]
    return [{"role": "user", "content": parts[::-1] if image_first else parts}]


def reference_of(path: Path):
    """mlx-vlm's greedy generation of one chat alone on the checkpoint at `path`
    (`run(messages)`: its token ids), with its model and processor."""
    from mlx_vlm import generate, load

    model, processor = load(str(path))

    def run(messages: list[dict], max_tokens: int = GREEDY.max_tokens) -> list[int]:
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

    run.model, run.processor = model, processor  # type: ignore[attr-defined]
    return run


@pytest.fixture(scope="module")
def reference():
    """mlx-vlm on the Qwen2.5-VL demo (`reference_of`)."""
    from stepline.engine.vision.demos import demo_path

    return reference_of(demo_path(name=VISION_QWEN_DEMO))


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl"))


async def greedy_chat(engine: Engine, messages: list[dict], **params: object) -> list:
    return await collect(
        engine.generate(messages=messages, params=GREEDY.model_copy(update=params))
    )


def token_ids(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_a_prompt_with_an_image_has_mlx_vlms_ids_and_positions(reference) -> None:
    from mlx_vlm.utils import prepare_inputs

    from stepline.engine.models import load_model

    loaded = load_model(VISION_QWEN_DEMO)
    from stepline.api.prompts import Prompts

    prompts = Prompts(
        loaded.tokenizer,
        vocab_size=loaded.vocab_size,
        max_context=loaded.max_context,
        images=loaded.vision.images,
    )
    image = png(0)
    prepared = prompts.prepare(messages=chat("What is in this picture?", image))
    processor = reference.processor
    text = processor.tokenizer.apply_chat_template(
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
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    inputs = prepare_inputs(processor, images=[pil], prompts=text)
    assert prepared.ids == inputs["input_ids"][0].tolist()
    (span,) = prepared.images
    assert span.end - span.start > 32  # more than a 32-token step: chunked as text
    positions, delta = loaded.vision.encoder.positions(prepared.ids, [span.inputs])
    want, want_delta = reference.model.language_model.get_rope_index(
        inputs["input_ids"], inputs["image_grid_thw"]
    )
    assert positions.tolist() == want[:, 0, :].tolist()
    assert delta == int(want_delta.item()) < 0  # the text after the image goes on from its grid


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("max_step_tokens", [32, 128])
async def test_concurrent_image_and_text_requests_answer_what_mlx_vlm_answers_each_alone(
    request: pytest.FixtureRequest, family: str, max_step_tokens: int
) -> None:
    # Qwen3-VL's vision tower also feeds the first text layers at the image's tokens
    # (deepstack), chunk by chunk.
    if family == "qwen3_vl":
        model = str(request.getfixturevalue("qwen3_vl"))
        reference = reference_of(Path(model))
    else:
        model, reference = VISION_QWEN_DEMO, request.getfixturevalue("reference")
    # Spans of 36 and 24 image tokens (their deltas differ); with 32-token steps the larger
    # one is chunked; the requests decode in one batch, their rows of different deltas, and
    # the text after an image is chunked beside them, at its own positions.
    long = "Tell me about the sea and the sky in this picture, at length please, and slowly."
    chats = [
        chat("What is in this picture?", png(0)),
        chat(long * 2, png(2, 80, 64), image_first=True),
        chat("Describe it in one word.", png(1, 60, 90)),
        chat("Tell me about the sea and the sky, at length please."),
        chat("And this one, what is it?", png(0)),
    ]
    async with Engine.open(model, max_step_tokens=max_step_tokens, max_num_seqs=8) as engine:
        assert engine.step_loop.runner.forwards.fuses  # decode rows ride in the chunks' forward
        assert engine.step_loop.runner.forwards.fuses_media  # and so do the image's chunks
        streams = await submit_together(engine, [{"messages": m, "params": GREEDY} for m in chats])
        results: list[list] = [[] for _ in chats]

        async def run(i: int) -> None:
            async with streams[i] as stream:
                results[i] = [out async for out in stream]

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(chats)):
                    tg.start_soon(run, i)
    expected = [reference(messages) for messages in chats]
    assert [token_ids(outs) for outs in results] == expected
    assert len({tuple(t) for t in expected}) == 5  # what the model says depends on the image


async def test_the_next_turn_with_the_same_image_is_a_prefix_hit_that_encodes_nothing(
    reference, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    first = chat("What is in this picture?", png(3))
    async with Engine.open(
        VISION_QWEN_DEMO, max_step_tokens=32, max_num_seqs=4, event_log=str(log)
    ) as engine:
        span = engine.prepare(messages=first).images[0]
        answer = await greedy_chat(engine, first)
        turn = [
            *first,
            {"role": "assistant", "content": "".join(o.text for o in answer)},
            {"role": "user", "content": "Say more."},
        ]
        more = await greedy_chat(engine, turn)
        # beside a chat of another image, decoding in the same batch as the next turn
        other = chat("What is in this picture?", png(4, 64, 48))
        together: list[list] = [[], []]

        async def run(i: int, messages: list[dict]) -> None:
            together[i] = await greedy_chat(engine, messages)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0, turn)
            tg.start_soon(run, 1, other)
    assert token_ids(answer) == reference(first)
    assert more[-1].num_cached_tokens >= span.end  # the image and its positions, from the cache
    assert token_ids(more) == token_ids(together[0]) == reference(turn)
    assert token_ids(together[1]) == reference(other)
    events = list(read_events(log))
    admitted = {e.request_id: e.images[0].digest for e in events if isinstance(e, Admitted)}
    encoded = [admitted[e.request_id] for e in events if isinstance(e, ImageEncoded)]
    # each image by one request (the first chat; the other chat): its next turns, none
    firsts = {e.request_id for e in events if isinstance(e, ImageEncoded)}
    assert len(firsts) == 2 and set(encoded) == set(admitted.values())


def test_stepline_generate_asks_the_qwen_demo_about_an_image_file(tmp_path: Path, capsys) -> None:
    from stepline.api.cli import main

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(7))
    argv = ["generate", "What is this?", "--image", str(picture), "--model", VISION_QWEN_DEMO]
    assert main([*argv, "--max-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert "output 6 tokens (length)" in out.err and out.out.strip()


async def test_the_chat_doors_answer_an_image_as_mlx_vlm_does(reference) -> None:
    import base64

    import anthropic

    image = png(5, 72, 56)
    want = reference(chat("What is in this picture?", image), max_tokens=8)
    data = base64.b64encode(image).decode()
    async with open_served(VISION_QWEN_DEMO, engine={"max_step_tokens": 32}) as served:
        tokenizer = served.engine.step_loop.runner.loaded.tokenizer
        text = tokenizer.decode(want)
        async with served.client() as client:
            answer = await client.chat.completions.create(
                model=VISION_QWEN_DEMO,
                max_tokens=8,
                temperature=0.0,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": f"data:image/png;base64,{data}"},
                            },
                        ],
                    }
                ],
            )
        assert answer.choices[0].message.content == text
        async with anthropic.AsyncAnthropic(
            base_url=served.url, api_key="sk-one", max_retries=0
        ) as claude:
            message = await claude.messages.create(
                model=VISION_QWEN_DEMO,
                max_tokens=8,
                extra_body={"temperature": 0.0},
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": data,
                                },
                            },
                        ],
                    }
                ],
            )
        assert "".join(b.text for b in message.content if b.type == "text") == text


async def test_a_run_with_qwen_images_is_re_executed_token_for_token(tmp_path: Path) -> None:
    from stepline.api.reexecute import reexecute

    log = tmp_path / "events.jsonl"
    chats = [
        chat("What is in this picture?", png(8)),
        chat("Describe it.", png(9, 60, 40), image_first=True),
        chat("Just text."),
    ]
    async with Engine.open(
        VISION_QWEN_DEMO, max_step_tokens=32, max_num_seqs=4, event_log=str(log)
    ) as engine:
        async with anyio.create_task_group() as tg:
            for messages in chats:
                tg.start_soon(greedy_chat, engine, messages)
    report = await reexecute(log, VISION_QWEN_DEMO)
    assert report.ok and report.num_compared == 3


def test_a_qwen_vl_family_not_served_is_refused_naming_the_served_ones(tmp_path: Path) -> None:
    import json

    from stepline.engine.images import VisionUnavailableError
    from stepline.engine.vision.load import load_vision

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(VisionUnavailableError, match="'qwen2_vl' are not served yet") as err:
        load_vision(tmp_path, lambda model: "")
    assert "qwen2_5_vl" in str(err.value)
