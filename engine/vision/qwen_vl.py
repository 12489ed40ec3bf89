"""Qwen2.5-VL and Qwen3-VL: an image is merged patches, one `<|image_pad|>` token each between
`<|vision_start|>` and `<|vision_end|>`; its encoder work is a block of the vision tower a
unit; the text model places tokens at 3-D M-RoPE positions, each request's own
(`engine/mrope.py`: the text model's ropes are mlx-vlm's, `QwenVLEncoder.positions`), and
Qwen3-VL's deepstack features, kept with the span's embeddings, are added by its first text
layers. `stepline-demo-vision-qwen` is a random-weight Qwen2.5-VL (`build_qwen2_5_vl`,
`demos.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from stepline.engine import demo_files, mrope
from stepline.engine.images import ImageData
from stepline.engine.vision.demos import DEMO_EOS, save_demo
from stepline.engine.vision.parts import EncodeJob, Expanded, VisionEncoder, scattered


class QwenVLImages:
    """Qwen2.5-VL and Qwen3-VL: an image is resized to a multiple of the merged patch (between the
    processor's min and max pixels) and cut into patches; each 2x2 of them, merged, is one
    `<|image_pad|>` token between `<|vision_start|>` and `<|vision_end|>` (the chat template's
    rendering of an image part, the processor's expansion of it). The vision tower runs over
    the whole image, block by block: its work comes in units of one block (32 on the real
    models), and the text model attends to image tokens causally, so the span is chunked as
    text once encoded. Its positions are 3-D (`engine/mrope.py`)."""

    def __init__(self, processor: Any, depth: int):
        self._processor = processor
        self._depth = depth
        tokenizer = processor.tokenizer
        self._pad = processor.image_token
        self._start = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self._end = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.placeholder = f"{self._start}{self._pad}{self._end}"  # the template's image part

    def expand(self, image: ImageData) -> Expanded:
        p = self._processor.image_processor
        out = p(images=[image.pixels])
        grid = np.asarray(out["image_grid_thw"]).reshape(-1, 3)
        count = int(grid.prod(axis=1).sum()) // p.merge_size**2
        inputs = {
            "pixel_values": np.asarray(out["pixel_values"]),
            "image_grid_thw": grid.astype(np.int32),
        }
        text = f"{self._start}{self._pad * count}{self._end}"
        return Expanded(text, inputs, units=self._depth, whole=False)


class QwenVLEncoder(VisionEncoder):
    """The vision tower of a Qwen2.5-VL or a Qwen3-VL (Qwen3-Omni's thinker's too), a block a
    unit, and its prompts' 3-D positions. `image_id`: the image token's id (by default the
    config's `image_token_index`, as mlx-vlm's Qwen3-VL reads it)."""

    def __init__(self, vlm: Any, text_model: Any, image_id: int | None = None):
        super().__init__(vlm, text_model)
        self._image_id = (
            getattr(vlm.config, "image_token_index", None) if image_id is None else image_id
        )

    def positions(
        self, prompt: list[int], inputs: list[Mapping[str, Any]]
    ) -> tuple[mx.array, int] | None:
        """A prompt's 3-D positions (3, L) and rope delta (`mrope.prompt_positions`), the
        prompt holding media of encoder `inputs` (in order): images by their grids, anything
        else (an omni thinker's clips) as text."""
        grids = [i["image_grid_thw"] for i in inputs if "image_grid_thw" in i]
        return mrope.prompt_positions(self.vlm, prompt, grids)

    def _run_units(self, job: EncodeJob, start: int, end: int) -> None:
        """Unit u is block u of the vision tower over the whole image (Qwen2.5-VL's windowed
        or full attention, as the tower's own `__call__` runs it; Qwen3-VL's full, its
        deepstack features taken after the blocks that make them); the last one merges the
        patches and puts them in the span (mlx-vlm's `get_input_embeddings`), with Qwen3-VL's
        deepstack features at the span's image tokens."""
        vlm, state = self.vlm, job.state
        tower = vlm.vision_tower
        stacked = getattr(tower, "deepstack_visual_indexes", None)  # Qwen3-VL's tower
        if not state:
            if stacked is None:
                state.update(_qwen_tower_inputs(tower, job.inputs))
            else:
                state.update(_qwen3_tower_inputs(tower, job.inputs))
        for u in range(start, end):
            full = stacked is not None or u in tower.fullatt_block_indexes
            state["hidden"] = tower.blocks[u](
                state["hidden"],
                cu_seqlens=state["cu_seqlens" if full else "cu_window_seqlens"],
                rotary_pos_emb=state["rotary"],
            )
            if stacked is not None and u in stacked:
                merger = tower.deepstack_merger_list[stacked.index(u)]
                state[f"deepstack{stacked.index(u)}"] = merger(state["hidden"])
        if end == job.units:
            ids = job.span_ids[None]
            if stacked is None:
                config = vlm.config
                embeds = vlm.language_model.model.embed_tokens(ids)
                features = tower.merger(state["hidden"])[mx.argsort(state["window_index"])]
                job.embeddings = vlm.merge_input_ids_with_image_features(
                    config.image_token_id, config.video_token_id, features, embeds, ids
                )
            else:
                embeds = self._embed_tokens(ids)
                mask = ids == self._image_id
                job.embeddings = scattered(embeds, mask, tower.merger(state["hidden"]))
                job.deepstack = mx.stack(
                    [
                        scattered(mx.zeros_like(embeds), mask, state[f"deepstack{i}"])
                        for i in range(len(stacked))
                    ]
                )
            state.clear()


def _qwen_tower_inputs(tower: Any, inputs: Mapping[str, Any]) -> dict[str, mx.array]:
    """What every block of a Qwen2.5-VL vision tower reads: the patches embedded and put in
    window order, their rotary embedding, and the windows' and the image's bounds, as the
    tower's `__call__` makes them before its blocks."""
    pixels = mx.array(inputs["pixel_values"]).astype(tower.patch_embed.proj.weight.dtype)
    grid = mx.array(inputs["image_grid_thw"])
    hidden = tower.patch_embed(pixels)
    rotary = tower.rot_pos_emb(grid)
    # (the tower's `__call__` then dedups the window bounds over a set of array elements,
    # which hash by identity: it keeps them all, and so does this, repeats included)
    window_index, cu_window = tower.get_window_index(grid)
    seq_len, unit = hidden.shape[0], tower.spatial_merge_unit
    hidden = hidden.reshape(seq_len // unit, unit, -1)[window_index].reshape(seq_len, -1)
    rotary = rotary.reshape(seq_len // unit, unit, -1)[window_index].reshape(seq_len, -1)
    lengths = [mx.repeat(grid[i, 1] * grid[i, 2], int(grid[i, 0])) for i in range(grid.shape[0])]
    cu_seqlens = mx.cumsum(mx.concatenate(lengths).astype(mx.int32), axis=0)
    cu_seqlens = mx.pad(cu_seqlens, (1, 0), mode="constant", constant_values=0)
    return {
        "hidden": hidden,
        "rotary": rotary,
        "window_index": window_index,
        "cu_window_seqlens": cu_window,
        "cu_seqlens": cu_seqlens,
    }


def _qwen3_tower_inputs(tower: Any, inputs: Mapping[str, Any]) -> dict[str, mx.array]:
    """What every block of a Qwen3-VL vision tower reads, as its `__call__` makes it before
    its blocks: the patches embedded, plus their interpolated position embeddings; their
    rotary embedding; the image's bounds."""
    pixels = mx.array(inputs["pixel_values"]).astype(tower.patch_embed.proj.weight.dtype)
    grid = mx.array(inputs["image_grid_thw"])
    hidden = tower.patch_embed(pixels) + tower.fast_pos_embed_interpolate(grid)
    seq_len = hidden.shape[0]
    rotary = tower.rot_pos_emb(grid).reshape(seq_len, -1)
    lengths = [mx.repeat(grid[i, 1] * grid[i, 2], int(grid[i, 0])) for i in range(grid.shape[0])]
    cu_seqlens = mx.cumsum(mx.concatenate(lengths).astype(mx.int32), axis=0)
    cu_seqlens = mx.pad(cu_seqlens, (1, 0), mode="constant", constant_values=0)
    return {"hidden": hidden.reshape(seq_len, -1), "rotary": rotary, "cu_seqlens": cu_seqlens}


def load_parts(vlm: Any, processor: Any, text_model: Any) -> tuple[QwenVLImages, VisionEncoder]:
    """A loaded Qwen2.5-VL's or Qwen3-VL's prompt side and encoder (mlx-vlm's model `vlm`, its
    processor, and the text model on its arrays, whose ropes become mlx-vlm's M-RoPE)."""
    mrope.install(text_model, vlm)
    images = QwenVLImages(processor, vlm.config.vision_config.depth)
    return images, QwenVLEncoder(vlm, text_model)


# -- the demo -------------------------------------------------------------------


# `stepline-demo-vision-qwen`: a Qwen2.5-VL of a 2-layer text model of the text demo's size
# (2 heads of 32, M-RoPE sections 4/6/6) and a 3-block vision tower (its last block of full
# attention, the others windowed) reading 8-pixel patches, merged 2x2: an image of up to
# 96x96 pixels becomes up to 36 tokens.
DEMO = {
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "vision": {
        "model_type": "qwen2_5_vl",
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 32,  # 2x2 merged patches a window
        "fullatt_block_indexes": [2],
        "in_channels": 3,
    },
    "min_pixels": 16 * 16,
    "max_pixels": 96 * 96,
    "seed": 7,
    "init_std": 0.08,  # larger: greedy decoding of the random model repeats one token
}
# Qwen2.5-VL's markup, added to the demo tokenizer as special tokens.
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_qwen2_5_vl(out: Path, shape: Mapping[str, Any]) -> None:
    """A random-weight Qwen2.5-VL checkpoint of `shape` (`DEMO`'s keys) at `out`, with
    the demo tokenizer, Qwen-VL's vision tokens added and a chat template that renders an
    image part as Qwen's `<|vision_start|><|image_pad|><|vision_end|>`. A Qwen3-VL where
    `shape["vision"]["model_type"]` is `qwen3_vl` (its text config nested, as its
    checkpoints have it)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(demo_files.train_tokenizer_json(1024))
    tokenizer.add_special_tokens(list(QWEN_VISION_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_VISION_TOKENS}
    template = demo_files.CHAT_TEMPLATE.replace(
        "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        "{%- elif part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- endif %}",
    )
    files = demo_files.tokenizer_files(shape["text"]["max_position_embeddings"])
    files["tokenizer_config.json"]["chat_template"] = template
    for filename, content in files.items():
        (out / filename).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    vision = shape["vision"]
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "min_pixels": shape["min_pixels"],
        "max_pixels": shape["max_pixels"],
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    vocab = tokenizer.get_vocab_size()
    model_type = vision["model_type"]
    text = {**shape["text"], "vocab_size": vocab}
    if model_type == "qwen3_vl":
        top: dict[str, Any] = {"text_config": {**text, "model_type": "qwen3_vl_text"}}
    else:
        top = text
    config = {
        "model_type": model_type,
        **top,
        "vocab_size": vocab,
        "vision_config": dict(vision),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": DEMO_EOS,
        "bos_token_id": demo_files.SPECIAL_TOKENS.index(demo_files.ENDOFTEXT),  # as Qwen's
        "torch_dtype": "float32",
    }
    media_ids = mx.arange(min(ids.values()), vocab)  # the vision tokens
    save_demo(out, config, shape, "language_model.lm_head.weight", media_ids)
