"""The text model of a multimodal checkpoint as the engine runs it: the mlx-lm model of the
checkpoint's text architecture, holding the mlx-vlm model's own text weight arrays (nothing
is copied), so that batched decode, fused steps and the prefix cache hold for it unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from stepline.engine.images import VisionUnavailableError

# a VLM's model_type -> its text model's mlx-lm architecture, where its config does not say
_TEXT_TYPES = {"gemma3": "gemma3_text", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
# a text config's model_type -> the mlx-lm architecture of that text model
_TEXT_ARCHS = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}


def text_model(vlm: Any, config: dict[str, Any]) -> Any:
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
