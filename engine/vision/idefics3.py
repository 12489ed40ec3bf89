"""Idefics3 (SmolVLM): an image is tiles plus a downscaled global view, each tile's patches
a run of image tokens between row/column markers; its encoder work is a layer of a tile a
unit. `stepline-demo-vision` is a random-weight one (`build_idefics3`, `demos.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from stepline.engine import demo_files
from stepline.engine.images import ImageData
from stepline.engine.vision.demos import DEMO_EOS, save_demo
from stepline.engine.vision.parts import EncodeJob, Expanded, VisionEncoder


class Idefics3Images:
    """Idefics3 / SmolVLM: an image is cut into tiles plus a downscaled global view; each
    tile's patches become `image_seq_len` tokens between row/column markers. The vision
    encoder reads each tile on its own, layer by layer: its work comes in units of one layer
    of one tile (on SmolVLM-256M, 13 tiles of a screenshot x 12 layers), and the text model
    attends to image tokens causally, so the span is chunked as text once encoded."""

    def __init__(self, processor: Any, num_layers: int = 1):
        from mlx_vlm.models.idefics3.processing_idefics3 import get_image_prompt_string

        self._processor = processor
        self._prompt_string = get_image_prompt_string
        self._num_layers = num_layers
        self.placeholder = processor.image_token  # what the chat template renders

    def expand(self, image: ImageData) -> Expanded:
        p = self._processor
        out = p.image_processor([[image.pixels]], return_row_col_info=True, return_tensors="np")
        text = self._prompt_string(
            out["rows"][0][0],
            out["cols"][0][0],
            p.image_seq_len,
            fake_token_around_image=p.fake_image_token,
            image_token=p.image_token,
            global_img_token=p.global_image_tag,
        )
        pixels = np.asarray(out["pixel_values"])
        inputs = {"pixel_values": pixels}
        if "pixel_attention_mask" in out:
            inputs["pixel_attention_mask"] = np.asarray(out["pixel_attention_mask"])
        tiles = int((pixels.reshape(pixels.shape[1], -1) != 0).any(axis=1).sum())  # no padding
        return Expanded(text, inputs, units=tiles * self._num_layers, whole=False)


class Idefics3Encoder(VisionEncoder):
    """Idefics3's vision encoder, a layer of one tile a unit."""

    def _run_units(self, job: EncodeJob, start: int, end: int) -> None:
        """Idefics3: unit u is layer u % L of tile u // L; a tile's last layer pools and
        projects it (mlx-vlm's `get_input_embeddings`, one tile at a time)."""
        vlm, state = self.vlm, job.state
        vision = vlm.vision_model
        layers = vision.encoder.layers
        if not state:
            state.update(_tiles(vlm, job.inputs))
            state["features"] = []
        for u in range(start, end):
            tile, layer = divmod(u, len(layers))
            if layer == 0:
                pixels = state["pixels"][tile : tile + 1]
                h = vision.embeddings(
                    pixels.transpose(0, 2, 3, 1),
                    patch_attention_mask=state["patch_mask"][tile : tile + 1],
                )
                h = h.astype(vision.embeddings.patch_embedding.weight.dtype)
            else:
                h = state["hidden"]
            h = layers[layer](h, mask=None)
            if layer == len(layers) - 1:
                pooled = vision.post_layernorm(h).astype(state["pixels"].dtype)
                features = vlm.connector(pooled)
                state["features"].append(features.reshape(-1, features.shape[-1]))
                state.pop("hidden", None)
            else:
                state["hidden"] = h
        if end == job.units:
            features = mx.concatenate(state["features"])
            ids = job.span_ids[None]
            job.embeddings = vlm._prepare_inputs_for_multimodal(
                features, vlm.language_model.embed_tokens(ids), ids
            )
            state.clear()


def _tiles(vlm: Any, inputs: Mapping[str, Any]) -> dict[str, mx.array]:
    """An image's tiles (padding tiles dropped) and each tile's patch mask, as mlx-vlm's
    Idefics3 `get_input_embeddings` makes them."""
    pixels = mx.array(inputs["pixel_values"])
    _, n, c, height, width = pixels.shape
    pixels = pixels.reshape(n, c, height, width)
    real = np.where(np.asarray((pixels == 0.0).sum(axis=(-1, -2, -3)) != c * height * width))[0]
    pixels = pixels[mx.array(real)]
    if "pixel_attention_mask" in inputs:
        mask = mx.array(inputs["pixel_attention_mask"]).reshape(n, height, width)
        mask = mask[mx.array(real)]
    else:
        mask = mx.ones((pixels.shape[0], height, width), dtype=mx.bool_)
    patch = vlm.config.vision_config.patch_size
    ph, pw = height // patch, width // patch
    blocks = mask[:, : ph * patch, : pw * patch].reshape(mask.shape[0], ph, patch, pw, patch)
    patch_mask = blocks.transpose(0, 1, 3, 2, 4).sum(axis=(-1, -2)) > 0
    return {"pixels": pixels, "patch_mask": patch_mask}


def load_parts(vlm: Any, processor: Any, text_model: Any) -> tuple[Idefics3Images, VisionEncoder]:
    """A loaded Idefics3's prompt side and encoder (mlx-vlm's model `vlm`, its processor, and
    the text model on its arrays)."""
    layers = vlm.config.vision_config.num_hidden_layers
    return Idefics3Images(processor, layers), Idefics3Encoder(vlm, text_model)


# -- the demo -------------------------------------------------------------------


# `stepline-demo-vision`'s shape: a 2-layer text model of the text demo's size; 64-pixel
# tiles of 8-pixel patches, shuffled by 2: 16 tokens a tile, up to 2x2 tiles and a global
# view (~90 tokens).
DEMO = {
    "text": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "vision": {
        "model_type": "idefics3",
        "hidden_size": 32,
        "num_attention_heads": 2,
        "patch_size": 8,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "image_size": 64,
    },
    "image_seq_len": 16,
    "longest_edge": 128,
    "seed": 5,
    "init_std": 0.05,
}


def build_idefics3(out: Path, shape: Mapping[str, Any], tokenizer_from: Path | None = None) -> None:
    """A random-weight Idefics3 checkpoint of `shape` (`DEMO`'s keys) at `out`, with the
    demo tokenizer (or the tokenizer files of the text checkpoint at `tokenizer_from`: its
    ids, the demo's ChatML template) and the image tokens added. The demo is one; the
    benchmarks build one of a real model's shape (random weights, the real costs)."""
    from mlx_vlm.models.idefics3.processing_idefics3 import Idefics3Processor
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    if tokenizer_from is None:
        tokenizer_json = demo_files.train_tokenizer_json(1024)
    else:
        tokenizer_json = (tokenizer_from / "tokenizer.json").read_text(encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    if tokenizer_from is None:
        max_context = shape["text"]["max_position_embeddings"]
        for filename, content in demo_files.tokenizer_files(max_context).items():
            (out / filename).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    else:
        config = (tokenizer_from / "tokenizer_config.json").read_text(encoding="utf-8")
        (out / "tokenizer_config.json").write_text(config, encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    tiles = shape["longest_edge"] // shape["vision"]["image_size"]
    rows = [f"<row_{r}_col_{c}>" for r in range(1, tiles + 1) for c in range(1, tiles + 1)]
    tokenizer.add_tokens(["<global-img>", *rows], special_tokens=False)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": shape["longest_edge"]},
        max_image_size={"longest_edge": shape["vision"]["image_size"]},
        do_image_splitting=True,
    )
    template = demo_files.CHAT_TEMPLATE.replace(
        "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        "{%- elif part['type'] == 'image' %}{{- '<image>' }}{%- endif %}",
    )
    tokenizer.chat_template = template
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=shape["image_seq_len"],
        chat_template=template,
    )
    processor.save_pretrained(str(out))
    vocab = len(processor.tokenizer)
    config = {
        "model_type": "idefics3",
        "text_config": {**shape["text"], "vocab_size": vocab},
        "vision_config": dict(shape["vision"]),
        "scale_factor": shape.get("scale_factor", 2),
        "image_token_id": processor.image_token_id,
        "vocab_size": vocab,
        "eos_token_id": DEMO_EOS,
        "torch_dtype": "float32",
    }
    image_tokens = mx.arange(len(tokenizer) - len(rows) - 1, vocab)  # markers, <image>, ...
    save_demo(out, config, shape, "language_model.lm_head.weight", image_tokens)
