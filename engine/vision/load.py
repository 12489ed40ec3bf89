"""Loading a multimodal checkpoint (mlx-vlm's layout): its family by its `model_type`
(`FAMILIES` for images, `engine/audio_model.AUDIO_FAMILIES` for audio, `engine/omni.py` for
Qwen3-Omni's thinker), mlx-vlm's model and processor, the text model on its arrays
(`text_model.py`), and the family's prompt side and encoder (`VisionParts`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.nn as nn

from stepline.engine.audio_model import AUDIO_FAMILIES, AudioEncoder, take_embeddings
from stepline.engine.images import VisionUnavailableError
from stepline.engine.omni import OMNI_TYPES, load_omni
from stepline.engine.vision import gemma3, idefics3, qwen_vl
from stepline.engine.vision.parts import VisionCheckpoint, VisionEncoder, VisionParts
from stepline.engine.vision.text_model import text_model

# model_type -> its family's prompt side and encoder, given mlx-vlm's model, its processor
# and the text model on its arrays
FAMILIES: dict[str, Callable[[Any, Any, Any], tuple[Any, VisionEncoder]]] = {
    "idefics3": idefics3.load_parts,
    "smolvlm": idefics3.load_parts,
    "gemma3": gemma3.load_parts,
    "qwen2_5_vl": qwen_vl.load_parts,
    "qwen3_vl": qwen_vl.load_parts,
}


def require_mlx_vlm() -> None:
    """Raises VisionUnavailableError, saying what to install, where mlx-vlm is not."""
    try:
        importlib.import_module("mlx_vlm")
    except ImportError:
        raise VisionUnavailableError(
            "this is a vision-language model: install the vision extra "
            "(pip install 'stepline[vision]', which brings mlx-vlm) to serve it"
        ) from None


def load_vision(path: Path, fit: Callable[[nn.Module], str]) -> VisionCheckpoint:
    """The vision-language checkpoint at `path` (mlx-vlm layout); `fit` casts the whole
    model's weights (`models.fit_dtype`) before the text model takes its own arrays.

    Raises VisionUnavailableError without mlx-vlm or for a family not in FAMILIES."""
    require_mlx_vlm()
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm
    from mlx_vlm.utils import load_processor

    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type in OMNI_TYPES:  # Qwen3-Omni's thinker: audio and images (engine/omni.py)
        return load_omni(path, config, fit)
    family = FAMILIES.get(model_type)
    hearing = AUDIO_FAMILIES.get(model_type)
    if family is None and hearing is None:
        raise VisionUnavailableError(
            f"vision-language models of type {model_type!r} are not served yet; served: "
            f"{', '.join(sorted([*FAMILIES, *AUDIO_FAMILIES, *OMNI_TYPES]))}"
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
    text = text_model(vlm, config)
    images, encoder = family(vlm, processor, text)
    parts = VisionParts(model_type, encoder, images)
    return VisionCheckpoint(text_model=text, tokenizer=tokenizer, parts=parts, weights=weights)


def _load_audio_model(
    path: Path, config: dict[str, Any], hearing: type, fit: Callable[[nn.Module], str]
) -> VisionCheckpoint:
    """An audio family's checkpoint (`engine/audio_model.py`): its text model, tokenizer and
    audio encoder; its images are not served (`VisionParts.images` None)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm

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
    text = text_model(vlm, {**config, "text_config": {**text_config, "model_type": "phi3"}})
    take_embeddings(text)
    parts = VisionParts(
        config["model_type"],
        VisionEncoder(vlm, text),
        images=None,
        audio=hearing(config),
        audio_encoder=AudioEncoder(vlm, text),
    )
    return VisionCheckpoint(text_model=text, tokenizer=tokenizer, parts=parts, weights=weights)
