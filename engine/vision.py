"""Vision-language models through mlx-vlm (the `vision` extra), served by the text engine.

A vision-language model is a text model that reads, at an image's token span, the vision
encoder's output instead of its token embeddings. stepline loads the checkpoint with mlx-vlm
(its model classes, processor and vision encoder) and runs the text part as the mlx-lm model
of the same architecture, on the same weight arrays, so everything the engine does for text
models (batched decode, fused steps, CPU attention, the prefix cache) holds for it unchanged.
An image's encoder work is its own, in units a step runs some of (`VisionEncoder.run`: for
Idefics3 one layer of one tile, for Qwen2.5-VL one block of its vision tower over the whole
image, for others the whole encoder, as mlx-vlm's `get_input_embeddings` runs it); its
output, the span's embeddings, is kept with the request, and a prompt chunk that holds image
tokens is fed those embeddings instead of the tokens'.

Families (`FAMILIES`): Idefics3 (SmolVLM) and Gemma 3, whose text models place tokens with
plain 1-D positions, and Qwen2.5-VL and Qwen3-VL, whose 3-D M-RoPE positions are each
request's own (`engine/mrope.py`: their text models' ropes are mlx-vlm's, each request's
positions and rope delta kept with it, `VisionEncoder.positions`; Qwen3-VL's deepstack
features, kept with the span's embeddings, are added by its first text layers).

`stepline-demo-vision` is a random-weight Idefics3 built on first use (like the text demos),
with the demo tokenizer, for tests and for trying images offline; `stepline-demo-vision-qwen`
a random-weight Qwen2.5-VL, the same way (`qwen_demo_path`).

mlx-vlm is imported only here, and this module only when a vision model is loaded.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import structlog
from mlx.utils import tree_flatten, tree_unflatten

from stepline.engine import demo_files, mrope
from stepline.engine.demo_files import VISION_DEMO, VISION_QWEN_DEMO
from stepline.engine.images import ImageData, VisionUnavailableError

log = structlog.get_logger(__name__)

_DEMO_BUILD_VERSION = 1


def _require_mlx_vlm() -> None:
    try:
        importlib.import_module("mlx_vlm")
    except ImportError:
        raise VisionUnavailableError(
            "this is a vision-language model: install the vision extra "
            "(pip install 'stepline[vision]', which brings mlx-vlm) to serve it"
        ) from None


@dataclass(frozen=True)
class Expanded:
    """One image as a prompt holds it: the text of its token span (markers and placeholder
    tokens, the family's own) and what the vision encoder reads (numpy arrays)."""

    text: str
    inputs: Mapping[str, np.ndarray]
    # text the family writes around the span, tokenized with the text beside it (as the
    # whole rendering would be: Gemma's blank lines merge with a turn's newline)
    lead: str = ""
    trail: str = ""
    units: int = 1  # the encoder's work, in units of like cost (a step runs some)
    whole: bool = True  # the span's tokens go in one chunk (else chunked once encoded)


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


class Gemma3Images:
    """Gemma 3: an image is resized to the encoder's square and becomes `mm_tokens_per_image`
    soft tokens between begin/end markers, a blank line either side (the processor's
    `full_image_sequence`). With pan-and-scan on in the processor's config, the span also
    holds the crops, each such a sequence, in the sentence mlx-vlm's processor writes."""

    def __init__(self, processor: Any):
        self._processor = processor
        self.placeholder = processor.boi_token

    def expand(self, image: ImageData) -> Expanded:
        p = self._processor
        out = p.image_processor([image.pixels], return_tensors="np")
        num_crops = int(np.asarray(out.get("num_crops", [0])).sum())
        text = p.boi_token
        if num_crops:  # as mlx_vlm.models.gemma3.processing_gemma3.Gemma3Processor.__call__
            text = (
                f"Here is the original image {p.boi_token} and here are some crops to help you "
                "see better " + " ".join([p.boi_token] * num_crops)
            )
        text = text.replace(p.boi_token, p.full_image_sequence)
        core = text.strip("\n")
        lead, trail = text[: len(text) - len(text.lstrip("\n"))], text[len(text.rstrip("\n")) :]
        # mlx-vlm's Gemma 3 makes a 4-D attention mask of `mask` beside the embeddings (and
        # fails without one); the span's embeddings do not depend on it.
        span = p.tokenizer.encode(core, add_special_tokens=False)
        inputs = {
            "pixel_values": np.asarray(out["pixel_values"]),
            "mask": np.ones((1, len(span)), dtype=np.int32),
        }
        return Expanded(core, inputs, lead=lead, trail=trail)


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


# model_type -> how its prompts hold images
FAMILIES: dict[str, type] = {
    "idefics3": Idefics3Images,
    "smolvlm": Idefics3Images,
    "gemma3": Gemma3Images,
    "qwen2_5_vl": QwenVLImages,
    "qwen3_vl": QwenVLImages,
}
# the families whose text models place tokens by 3-D M-RoPE positions (`engine/mrope.py`)
MROPE_FAMILIES = frozenset({"qwen2_5_vl", "qwen3_vl"})
# omni models, audio and images (`engine/omni.py`'s OMNI_TYPES; it imports this module)
_OMNI_TYPES = frozenset({"qwen3_omni_moe"})


class EncodeJob:
    """One image's encoder work in progress on the executor: what the family keeps between
    units, and, once all are done, the span's input embeddings (1, span, D)."""

    def __init__(self, span_ids: mx.array, inputs: Mapping[str, Any], units: int) -> None:
        self.span_ids = span_ids  # (span,) int32
        self.inputs = inputs
        self.units = units
        self.done = 0
        self.state: dict[str, Any] = {}
        self.embeddings: mx.array | None = None
        # Qwen3-VL's: what its first text layers add at the span's image tokens (k, 1, span, D)
        self.deepstack: mx.array | None = None


class VisionEncoder:
    """The vision side of a loaded model, on the executor's thread: an image's encoder work,
    unit by unit (`run`), and a prompt chunk's input embeddings (`embeddings`)."""

    def __init__(self, vlm: Any, text_model: Any, model_type: str):
        self.vlm = vlm
        self._embed_tokens = text_model.model.embed_tokens
        self._tiled = FAMILIES.get(model_type) is Idefics3Images
        self._blocks = FAMILIES.get(model_type) is QwenVLImages
        self.is_mrope = model_type in MROPE_FAMILIES  # positions are each request's own

    def positions(
        self, prompt: list[int], inputs: list[Mapping[str, Any]]
    ) -> tuple[mx.array, int] | None:
        """A prompt's 3-D positions (3, L) and rope delta (`mrope.prompt_positions`), the
        prompt holding images of encoder `inputs` (in order); None for 1-D positions."""
        if not self.is_mrope:
            return None
        grids = [i["image_grid_thw"] for i in inputs]
        return mrope.prompt_positions(self.vlm, prompt, grids)

    def run(self, job: EncodeJob, start: int, end: int) -> None:
        """Units [start, end) of `job`, evaluated; the span's embeddings at its last."""
        assert start == job.done < end <= job.units, (start, end, job.done, job.units)
        if self._tiled:
            self._run_tiles(job, start, end)
        elif self._blocks:
            self._run_blocks(job, start, end)
        else:  # one unit: the family's whole encoder, as mlx-vlm runs it
            arrays = {k: mx.array(v) for k, v in job.inputs.items()}
            out = self.vlm.get_input_embeddings(job.span_ids[None], **arrays)
            job.embeddings = getattr(out, "inputs_embeds", out)
        job.done = end
        mx.eval(job.embeddings if job.embeddings is not None else list(job.state.values()))

    def _run_tiles(self, job: EncodeJob, start: int, end: int) -> None:
        """Idefics3: unit u is layer u % L of tile u // L; a tile's last layer pools and
        projects it (mlx-vlm's `get_input_embeddings`, one tile at a time)."""
        vlm, state = self.vlm, job.state
        vision = vlm.vision_model
        layers = vision.encoder.layers
        if not state:
            state.update(_idefics3_tiles(vlm, job.inputs))
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

    def _run_blocks(self, job: EncodeJob, start: int, end: int) -> None:
        """Qwen2.5-VL: unit u is block u of the vision tower over the whole image (its
        windowed or full attention, as the tower's own `__call__` runs it); the last one merges
        the patches and puts them in the span (mlx-vlm's `get_input_embeddings`)."""
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
            config = vlm.config
            embeds = vlm.language_model.model.embed_tokens(ids)
            if stacked is None:
                features = tower.merger(state["hidden"])[mx.argsort(state["window_index"])]
                job.embeddings = vlm.merge_input_ids_with_image_features(
                    config.image_token_id, config.video_token_id, features, embeds, ids
                )
            else:
                job.embeddings = _scattered(embeds, ids, tower.merger(state["hidden"]), config)
                job.deepstack = mx.stack(
                    [
                        _scattered(mx.zeros_like(embeds), ids, state[f"deepstack{i}"], config)
                        for i in range(len(stacked))
                    ]
                )
            state.clear()

    def deepstack(
        self, length: int, start: int, spans: tuple[tuple[int, int, mx.array], ...]
    ) -> mx.array | None:
        """(k, 1, L, D): what the first k text layers add to prompt positions start..start + L
        (Qwen3-VL's deepstack: zero but at image tokens), where `spans` are (span start, span
        end, the span's deepstack (k, 1, span, D)) overlapping them; None without any."""
        if not spans:
            return None
        pieces, at = [], start
        end = start + length
        k, _, _, dim = spans[0][2].shape
        for s, e, stack in spans:
            if s > at:
                pieces.append(mx.zeros((k, 1, s - at, dim), dtype=stack.dtype))
            lo, hi = max(s, at), min(e, end)
            pieces.append(stack[:, :, lo - s : hi - s])
            at = hi
        if end > at:
            pieces.append(mx.zeros((k, 1, end - at, dim), dtype=pieces[0].dtype))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)

    def embeddings(
        self, ids: mx.array, start: int, spans: tuple[tuple[int, int, mx.array], ...]
    ) -> mx.array:
        """(1, L, D) input embeddings of prompt tokens `ids` (positions start..start + L),
        where `spans` are (span start, span end, the span's embeddings) overlapping it."""
        pieces, at = [], start
        end = start + ids.shape[0]
        for s, e, embeds in spans:
            if s > at:
                pieces.append(self._embed_tokens(ids[None, at - start : s - start]))
            lo, hi = max(s, at), min(e, end)
            pieces.append(
                embeds[:, lo - s : hi - s].astype(pieces[0].dtype if pieces else embeds.dtype)
            )
            at = hi
        if end > at:
            pieces.append(self._embed_tokens(ids[None, at - start :]))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)


def _idefics3_tiles(vlm: Any, inputs: Mapping[str, Any]) -> dict[str, mx.array]:
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


def _scattered(base: mx.array, ids: mx.array, features: mx.array, config: Any) -> mx.array:
    """`base` (1, span, D) with the image tokens' rows of `ids` replaced by `features`, in
    order (mlx-vlm's Qwen3-VL `masked_scatter`)."""
    from mlx_vlm.models.qwen3_vl.qwen3_vl import masked_scatter

    mask = ids == config.image_token_index
    return masked_scatter(base, mx.broadcast_to(mask[..., None], base.shape), features)


@dataclass(frozen=True)
class VisionParts:
    """What a LoadedModel of a vision-language (or audio) model carries beside the text
    model: per medium, its prompt side and its encoder."""

    model_type: str
    encoder: VisionEncoder  # executor thread only
    # Idefics3Images | Gemma3Images | QwenVLImages: prompt-side, MLX-free calls; None: no images
    images: Any
    audio: Any = None  # `engine.audio_model` Phi4mmAudio: prompt-side; None: no audio tower
    audio_encoder: Any = None  # `engine.audio_model.AudioEncoder`: executor thread only

    def encoder_of(self, medium: str) -> Any:
        """The encoder that runs a span of `medium`'s units (`run(job, start, end)`)."""
        return self.audio_encoder if medium == "audio" else self.encoder


# a VLM's model_type -> its text model's mlx-lm architecture, where its config does not say
_TEXT_TYPES = {"gemma3": "gemma3_text", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
# a text config's model_type -> the mlx-lm architecture of that text model
_TEXT_ARCHS = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}


def _text_model(vlm: Any, config: dict[str, Any]) -> Any:
    """The mlx-lm model of the VLM's text architecture, holding the VLM's own text weights
    (the same arrays: nothing is copied)."""
    text_config = dict(config.get("text_config") or {})
    lm_config = getattr(vlm.config, "text_config", None)
    if lm_config is not None and hasattr(lm_config, "__dataclass_fields__"):
        import dataclasses

        text_config = {**dataclasses.asdict(lm_config), **text_config}
    model_type = text_config.get("model_type")
    if model_type in (None, config.get("model_type")):  # gemma3's text part
        model_type = _TEXT_TYPES.get(config.get("model_type", ""), model_type)
        text_config["model_type"] = model_type
    model_type = _TEXT_ARCHS.get(model_type, model_type)
    try:
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        raise VisionUnavailableError(
            f"the text model of this {config.get('model_type')} checkpoint ({model_type}) is "
            "not an mlx-lm architecture"
        ) from None
    model = arch.Model(arch.ModelArgs.from_dict(text_config))
    source = dict(tree_flatten(vlm.language_model.parameters()))

    def in_source(key: str) -> str | None:
        for candidate in (key, key.removeprefix("model."), f"model.{key}"):
            if candidate in source:
                return candidate
        return None

    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization and any(k.endswith(".scales") for k in source):  # kept quantized
        nn.quantize(
            model,
            group_size=quantization.get("group_size", 64),
            bits=quantization.get("bits", 4),
            mode=quantization.get("mode", "affine"),
            class_predicate=lambda path, _: in_source(f"{path}.scales") is not None,
        )
    mine = dict(tree_flatten(model.parameters()))
    weights = []
    for key in mine:
        found = in_source(key)
        if found is not None:
            weights.append((key, source[found]))
        else:
            tied = [k for k in source if k.endswith("embed_tokens.weight")]
            if key == "lm_head.weight" and tied:  # the VLM ties it to the embeddings
                weights.append((key, source[tied[0]]))
                continue
            raise VisionUnavailableError(f"the text model's weight {key} is not in the checkpoint")
    model.update(tree_unflatten(weights))
    return model


@dataclass(frozen=True)
class VisionCheckpoint:
    """A vision-language checkpoint as loaded: what `load_model` makes a LoadedModel of."""

    text_model: nn.Module  # the language model the engine runs (`_text_model`)
    tokenizer: Any  # mlx-lm's TokenizerWrapper, with the processor's end tokens
    parts: VisionParts  # its encoder and image prompts (LoadedModel.vision)
    weights: str  # what `fit` chose for the weights, and why


def load_vision(path: Path, fit: Callable[[nn.Module], str]) -> VisionCheckpoint:
    """The vision-language checkpoint at `path` (mlx-vlm layout); `fit` casts the whole
    model's weights (`models.fit_dtype`) before the text model takes its own arrays.

    Raises VisionUnavailableError without mlx-vlm or for a family not in FAMILIES."""
    _require_mlx_vlm()
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm
    from mlx_vlm.utils import load_processor

    from stepline.engine.audio_model import AUDIO_FAMILIES

    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type in _OMNI_TYPES:  # Qwen3-Omni's thinker: audio and images (engine/omni.py)
        from stepline.engine.omni import load_omni

        return load_omni(path, config, fit)
    family = FAMILIES.get(model_type)
    hearing = AUDIO_FAMILIES.get(model_type)
    if family is None and hearing is None:
        raise VisionUnavailableError(
            f"vision-language models of type {model_type!r} are not served yet; served: "
            f"{', '.join(sorted([*FAMILIES, *AUDIO_FAMILIES, *_OMNI_TYPES]))}"
        )
    if hearing is not None:
        return _load_audio_model(path, config, hearing, fit)
    vlm = load_vlm(path)
    weights = fit(vlm)
    processor = load_processor(path, add_detokenizer=False)
    eos = config.get("eos_token_id") or config.get("text_config", {}).get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    eos_ids += [t for t in getattr(processor, "additional_eos_token_ids", ()) if t is not None]
    tokenizer = load_tokenizer(path, eos_token_ids=sorted(set(eos_ids)) or None)
    if family is Idefics3Images:
        images = family(processor, vlm.config.vision_config.num_hidden_layers)
    elif family is QwenVLImages:
        images = family(processor, vlm.config.vision_config.depth)
    else:
        images = family(processor)
    text = _text_model(vlm, config)
    if model_type in MROPE_FAMILIES:
        mrope.install(text, vlm)
    parts = VisionParts(model_type, VisionEncoder(vlm, text, model_type), images)
    return VisionCheckpoint(text_model=text, tokenizer=tokenizer, parts=parts, weights=weights)


def _load_audio_model(
    path: Path, config: dict[str, Any], hearing: type, fit: Callable[[nn.Module], str]
) -> VisionCheckpoint:
    """An audio family's checkpoint (`engine/audio_model.py`): its text model, tokenizer and
    audio encoder; its images are not served (`VisionParts.images` None)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm

    from stepline.engine.audio_model import AudioEncoder, take_embeddings

    vlm = load_vlm(path)
    if getattr(vlm, "_base_weights", None):
        # Phi-4-multimodal switches LoRA weights per request's media (text, vision, speech):
        # one batch has one set, so both adapters stay merged, as mlx-vlm's quantized
        # conversions ship them (its `quant_predicate`).
        vlm.apply_both_loras()
        vlm._base_weights = {}
    weights = fit(vlm)
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tokenizer = load_tokenizer(path, eos_token_ids=sorted(set(eos_ids)) or None)
    # the text model's config is the checkpoint's top level (Phi-3's names)
    media = ("text_config", "vision_config", "audio_processor", "embd_layer", "vision_lora")
    text_config = {k: v for k, v in config.items() if k not in (*media, "speech_lora")}
    text = _text_model(vlm, {**config, "text_config": {**text_config, "model_type": "phi3"}})
    take_embeddings(text)
    parts = VisionParts(
        config["model_type"],
        VisionEncoder(vlm, text, config["model_type"]),
        images=None,
        audio=hearing(config),
        audio_encoder=AudioEncoder(vlm, text),
    )
    return VisionCheckpoint(text_model=text, tokenizer=tokenizer, parts=parts, weights=weights)


# -- the demo -------------------------------------------------------------------


def demo_path(cache_dir: str | Path | None = None, name: str = VISION_DEMO) -> Path:
    """The directory of the vision demo `name` (`stepline-demo-vision`, an Idefics3, or
    `stepline-demo-vision-qwen`, a Qwen2.5-VL), built there on first use."""
    qwen = name == VISION_QWEN_DEMO
    shape, build = (_QWEN_DEMO, _build_qwen_demo) if qwen else (_DEMO, _build_demo)
    return demo_files.multimodal_demo_path(name, _DEMO_BUILD_VERSION, shape, build, cache_dir)


# The demo's shape: a 2-layer text model of the text demo's size; 64-pixel tiles of 8-pixel
# patches, shuffled by 2: 16 tokens a tile, up to 2x2 tiles and a global view (~90 tokens).
_DEMO = {
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


def _build_demo(out: Path) -> None:
    build_idefics3(out, _DEMO)


def build_idefics3(out: Path, shape: Mapping[str, Any], tokenizer_from: Path | None = None) -> None:
    """A random-weight Idefics3 checkpoint of `shape` (`_DEMO`'s keys) at `out`, with the
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
    eos = [
        demo_files.SPECIAL_TOKENS.index(demo_files.IM_END),
        demo_files.SPECIAL_TOKENS.index(demo_files.ENDOFTEXT),
    ]
    config = {
        "model_type": "idefics3",
        "text_config": {**shape["text"], "vocab_size": vocab},
        "vision_config": dict(shape["vision"]),
        "scale_factor": shape.get("scale_factor", 2),
        "image_token_id": processor.image_token_id,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    weights = random_weights(config, shape["seed"], shape["init_std"])
    # As in the text demos: a random model must not rank the special tokens first.
    head = "language_model.lm_head.weight"
    added = len(demo_files.SPECIAL_TOKENS) + len(demo_files.MARKUP_TOKENS)
    image_tokens = mx.arange(len(tokenizer) - len(rows) - 1, vocab)  # markers, <image>, ...
    reserved = mx.concatenate([mx.arange(added), image_tokens])
    weights[head] = weights[head].at[reserved].multiply(0.0)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# `stepline-demo-vision-qwen`: a Qwen2.5-VL of a 2-layer text model of the text demo's size
# (2 heads of 32, M-RoPE sections 4/6/6) and a 3-block vision tower (its last block of full
# attention, the others windowed) reading 8-pixel patches, merged 2x2: an image of up to
# 96x96 pixels becomes up to 36 tokens.
_QWEN_DEMO = {
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


def _build_qwen_demo(out: Path) -> None:
    build_qwen2_5_vl(out, _QWEN_DEMO)


def build_qwen2_5_vl(out: Path, shape: Mapping[str, Any]) -> None:
    """A random-weight Qwen2.5-VL checkpoint of `shape` (`_QWEN_DEMO`'s keys) at `out`, with
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
    eos = [
        demo_files.SPECIAL_TOKENS.index(demo_files.IM_END),
        demo_files.SPECIAL_TOKENS.index(demo_files.ENDOFTEXT),
    ]
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
        "eos_token_id": eos,
        "bos_token_id": demo_files.SPECIAL_TOKENS.index(demo_files.ENDOFTEXT),  # as Qwen's
        "torch_dtype": "float32",
    }
    weights = random_weights(config, shape["seed"], shape["init_std"])
    # As in the text demos: a random model must not rank the special tokens first.
    head = "language_model.lm_head.weight"
    added = len(demo_files.SPECIAL_TOKENS) + len(demo_files.MARKUP_TOKENS)
    reserved = mx.concatenate([mx.arange(added), mx.arange(min(ids.values()), vocab)])
    weights[head] = weights[head].at[reserved].multiply(0.0)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def random_weights(
    config: Mapping[str, Any],
    seed: int,
    init_std: float,
    norm: Callable[[str], float] | None = None,
) -> dict[str, mx.array]:
    """Seeded random float32 weights of the mlx-vlm model that `config` (a config.json)
    describes, by parameter name: biases 0, norms `norm(name)` (default 1), the rest normal
    of `init_std`, each from its own key (independent of MLX's global RNG)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    raw = json.loads(json.dumps(config))
    module, _ = get_model_and_args(raw)
    model = module.Model(
        update_module_configs(module.ModelConfig.from_dict(raw), module, raw, ["text", "vision"])
    )
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = {}
    for i, name in enumerate(names):
        dims = params[name].shape
        if name.endswith("bias"):
            value = mx.zeros(dims)
        elif "norm" in name and len(dims) == 1:
            value = mx.full(dims, norm(name) if norm is not None else 1.0)
        else:
            value = init_std * mx.random.normal(dims, key=keys[i])
        weights[name] = value.astype(mx.float32)
    return weights
