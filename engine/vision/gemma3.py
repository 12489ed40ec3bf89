"""Gemma 3: an image is resized to the encoder's square and becomes its soft tokens between
begin/end markers; its encoder work is one unit, the whole encoder as mlx-vlm runs it (the
base `VisionEncoder`'s).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stepline.engine.images import ImageData
from stepline.engine.vision.parts import Expanded, VisionEncoder


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


def load_parts(vlm: Any, processor: Any, text_model: Any) -> tuple[Gemma3Images, VisionEncoder]:
    """A loaded Gemma 3's prompt side and encoder (mlx-vlm's model `vlm`, its processor, and
    the text model on its arrays)."""
    return Gemma3Images(processor), VisionEncoder(vlm, text_model)
