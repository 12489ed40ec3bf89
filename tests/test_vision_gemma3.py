"""Gemma 3 with images: stepline's prompt ids and greedy tokens are mlx-vlm's own, on a tiny
random-weight checkpoint built offline (`vision_checkpoints.tiny_gemma3`).

mlx-vlm is the reference for what the model is fed (its processor's text for an image, its
vision tower and projector), run on the same prompt ids: mlx-vlm 0.7.10 tokenizes a Gemma 3
rendering, which starts with the template's `<bos>`, with the tokenizer's own `<bos>` added
too (its `Gemma3Processor.from_pretrained` leaves the processor's `chat_template` unset, so
`should_add_special_tokens` says yes, and its `__call__` takes no `add_special_tokens`), so it
is given the rendering less its `<bos>` (`reference_prompt`): the same ids as stepline's.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import submit_together
from vision_checkpoints import BOI, BOS, NEWLINE_RUNS, START_OF_TURN, tiny_gemma3

from stepline.api import Engine, SamplingParams
from stepline.api.prompts import Prompts

pytest.importorskip("mlx_vlm")  # the vision extra

Image = pytest.importorskip("PIL.Image")

MAX_STEP_TOKENS = 8  # below an image's span (22 tokens): a span runs alone, past the budget
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def pan_and_scan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("gemma3-pan-and-scan"), pan_and_scan=True)


def png(seed: int, width: int = 150, height: int = 100) -> bytes:
    """A PNG of random pixels (wider than tall: pan-and-scan cuts it in two)."""
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat(image: bytes | None, *, image_first: bool = False) -> list[dict]:
    """A user turn with the question and, if given, an image after it (or before it)."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if image is not None:
        parts.insert(0 if image_first else 1, {"type": "image", "image": image})
    return [{"role": "user", "content": parts}]


def prompts(path: Path) -> Prompts:
    """stepline's prompt preparation for the checkpoint at `path`, as its engine has it."""
    from stepline.engine.models import load_model

    loaded = load_model(str(path))
    return Prompts(
        loaded.tokenizer,
        vocab_size=loaded.vocab_size,
        max_context=loaded.max_context,
        images=loaded.vision.images,
    )


@pytest.fixture(scope="module")
def stepline_prompts(checkpoint: Path) -> Prompts:
    return prompts(checkpoint)


def reference_prompt(processor: Any, messages: list[dict]) -> str:
    """The chat template's rendering of `messages` as mlx-vlm's processor takes it: image
    parts without their bytes, and without the template's `<bos>`, which mlx-vlm's
    tokenization adds again (see the module's docstring)."""
    plain = [
        {**m, "content": [{k: v for k, v in p.items() if k != "image"} for p in m["content"]]}
        for m in messages
    ]
    text = processor.tokenizer.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith(BOS)
    return text.removeprefix(BOS)


def reference_ids(processor: Any, messages: list[dict], image: bytes | None) -> list[int]:
    """mlx-vlm's prompt ids for `messages` holding `image` (mlx_vlm.utils.prepare_inputs)."""
    from mlx_vlm.utils import prepare_inputs

    images = None if image is None else [Image.open(io.BytesIO(image)).convert("RGB")]
    # With an image, mlx-vlm's processor adds the <bos> whatever add_special_tokens says.
    inputs = prepare_inputs(
        processor,
        images=images,
        prompts=reference_prompt(processor, messages),
        add_special_tokens=True,
    )
    return inputs["input_ids"][0].tolist()


def reference_tokens(model: Any, processor: Any, messages: list[dict], image: bytes | None):
    """mlx-vlm's greedy tokens for `messages` holding `image` (mlx_vlm.generate)."""
    from mlx_vlm import generate

    images = None if image is None else [Image.open(io.BytesIO(image)).convert("RGB")]
    out = generate(
        model,
        processor,
        reference_prompt(processor, messages),
        image=images,
        max_tokens=GREEDY.max_tokens,
        temperature=0.0,
        verbose=False,
    )
    return list(out.token_ids)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[Any, Any]:
    """mlx-vlm's model and processor of the checkpoint."""
    from mlx_vlm.utils import load

    return load(str(checkpoint))


def test_a_prompt_with_an_image_has_mlx_vlms_ids(stepline_prompts, reference):
    image = png(0)
    prepared = stepline_prompts.prepare(messages=chat(image))
    assert prepared.ids == reference_ids(reference[1], chat(image), image)
    (span,) = prepared.images
    assert span.end - span.start > MAX_STEP_TOKENS


def test_a_gemma3_prompt_starts_with_one_bos(stepline_prompts, reference):
    tokenizer = reference[1].tokenizer
    start = [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(START_OF_TURN)]
    for messages in (chat(png(0)), chat(None)):
        assert stepline_prompts.prepare(messages=messages).ids[:2] == start


def test_an_image_first_in_its_turn_has_mlx_vlms_ids(stepline_prompts, reference):
    assert "\n\n\n" in NEWLINE_RUNS  # "user\n" + "\n\n<start_of_image>": one token
    image = png(0)
    messages = chat(image, image_first=True)
    ids = stepline_prompts.prepare(messages=messages).ids
    assert ids == reference_ids(reference[1], messages, image)


async def test_images_and_text_decode_together_as_mlx_vlm_decodes_each(
    checkpoint, reference, model_cache_dir
):
    images = [png(0), png(1), None]
    requests = [chat(image) for image in images]
    async with Engine.open(
        model=str(checkpoint), max_step_tokens=MAX_STEP_TOKENS, max_num_seqs=4
    ) as engine:
        for messages, image in zip(requests, images, strict=True):
            ids = engine.prepare(messages=messages).ids
            assert ids == reference_ids(reference[1], messages, image)
        streams = await submit_together(
            engine, [{"messages": m, "params": GREEDY} for m in requests]
        )
        tokens: list[list[int]] = [[] for _ in streams]

        async def collect(i: int) -> None:
            async with streams[i] as stream:
                async for out in stream:
                    tokens[i].extend(out.token_ids)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(streams)):
                    tg.start_soon(collect, i)
    expected = [
        reference_tokens(*reference, messages, image)
        for messages, image in zip(requests, images, strict=True)
    ]
    assert tokens == expected
    assert len({tuple(t) for t in expected}) == 3  # what the model says depends on the image


async def test_pan_and_scan_crops_are_encoded_as_mlx_vlm_encodes_them(
    pan_and_scan_checkpoint, model_cache_dir
):
    from mlx_vlm.utils import load

    model, processor = load(str(pan_and_scan_checkpoint))
    image = png(2)
    messages = chat(image)
    async with Engine.open(
        model=str(pan_and_scan_checkpoint), max_step_tokens=MAX_STEP_TOKENS, max_num_seqs=4
    ) as engine:
        prepared = engine.prepare(messages=messages)
        assert prepared.ids == reference_ids(processor, messages, image)
        boi = processor.tokenizer.convert_tokens_to_ids(BOI)
        assert prepared.ids.count(boi) == 3  # the image and its two crops
        tokens: list[int] = []
        with anyio.fail_after(60):
            async for out in engine.generate(messages=messages, params=GREEDY):
                tokens.extend(out.token_ids)
    assert tokens == reference_tokens(model, processor, messages, image)
