"""What every vision (and audio) family shares: a medium's span as a prompt holds it
(`Expanded`, made off the executor, MLX-free calls), its encoder work in progress
(`EncodeJob`), the encoder's contract (`VisionEncoder`: units a step runs some of, and a
prompt chunk's input embeddings with the spans' in place of the tokens'), and what a loaded
model carries beside its text model (`VisionParts`, `VisionCheckpoint`).

A family's module (`idefics3.py`, `gemma3.py`, `qwen_vl.py`, `engine/audio_model.py`,
`engine/omni.py`) says what its units are; the base encoder runs the family's whole encoder
as one unit, as mlx-vlm's `get_input_embeddings` runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


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
    unit by unit (`run`), and a prompt chunk's input embeddings (`embeddings`). This base
    runs the whole encoder as one unit and places tokens at 1-D positions; a family whose
    work comes in smaller units overrides `_run_units`, one with 3-D positions `positions`."""

    def __init__(self, vlm: Any, text_model: Any):
        self.vlm = vlm
        self._embed_tokens = text_model.model.embed_tokens

    def positions(
        self, prompt: list[int], inputs: list[Mapping[str, Any]]
    ) -> tuple[mx.array, int] | None:
        """A prompt's 3-D positions (3, L) and rope delta (`mrope.prompt_positions`), the
        prompt holding media of encoder `inputs` (in order); None for 1-D positions."""
        return None

    def run(self, job: EncodeJob, start: int, end: int) -> None:
        """Units [start, end) of `job`, evaluated; the span's embeddings at its last."""
        assert start == job.done < end <= job.units, (start, end, job.done, job.units)
        self._run_units(job, start, end)
        job.done = end
        mx.eval(job.embeddings if job.embeddings is not None else list(job.state.values()))

    def _run_units(self, job: EncodeJob, start: int, end: int) -> None:
        """One unit: the family's whole encoder, as mlx-vlm runs it."""
        arrays = {k: mx.array(v) for k, v in job.inputs.items()}
        out = self.vlm.get_input_embeddings(job.span_ids[None], **arrays)
        job.embeddings = getattr(out, "inputs_embeds", out)

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


def scattered(base: mx.array, mask: mx.array, features: mx.array) -> mx.array:
    """`base` (1, span, D) with the rows where `mask` (1, span) holds replaced by `features`,
    in order, cast to `base`'s dtype (mlx-vlm's Qwen3-VL and Qwen3-Omni `masked_scatter`)."""
    rows = mx.array(np.flatnonzero(np.asarray(mask).reshape(-1)).astype(np.uint32))
    out = base.reshape(-1, base.shape[-1])
    out[rows] = features.reshape(-1, base.shape[-1]).astype(base.dtype)
    return out.reshape(base.shape)


@dataclass(frozen=True)
class VisionParts:
    """What a LoadedModel of a vision-language (or audio) model carries beside the text
    model: per medium, its prompt side and its encoder."""

    model_type: str
    encoder: VisionEncoder  # executor thread only
    # a family's prompt side (`idefics3.Idefics3Images`, ..., `omni.OmniImages`): MLX-free
    # calls; None: no images
    images: Any
    audio: Any = None  # `engine.audio_model` Phi4mmAudio: prompt-side; None: no audio tower
    audio_encoder: Any = None  # `engine.audio_model.AudioEncoder`: executor thread only

    def encoder_of(self, medium: str) -> Any:
        """The encoder that runs a span of `medium`'s units (`run(job, start, end)`)."""
        return self.audio_encoder if medium == "audio" else self.encoder


@dataclass(frozen=True)
class VisionCheckpoint:
    """A vision-language checkpoint as loaded: what `load_model` makes a LoadedModel of."""

    text_model: nn.Module  # the language model the engine runs (`text_model.py`)
    tokenizer: Any  # mlx-lm's TokenizerWrapper, with the processor's end tokens
    parts: VisionParts  # its encoder and image prompts (LoadedModel.vision)
    weights: str  # what `fit` chose for the weights, and why
