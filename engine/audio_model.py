"""Audio models through mlx-vlm (the `vision` extra): the family's prompt side (a clip's token
span and its encoder's inputs) and its audio encoder's work, unit by unit, on the executor.

A clip is, to the text model, a span of placeholder tokens whose input embeddings are the
audio encoder's output (as an image's are the vision encoder's): the span rides the same
scheduler as images (`actors/scheduler/spans.py`, a `PromptImage` of medium "audio"), atomic
(`whole`: its tokens go in one chunk, deferred when a step cannot hold them), keyed in the
prefix cache by the clip's digest. The encoder's work comes in units a step runs some of.

Families (`AUDIO_FAMILIES`): Phi-4-multimodal (`phi4mm`), whose text model is mlx-lm's Phi-3
(plain 1-D positions) and whose audio encoder is a Conformer: one unit per Conformer block,
the subsampling with the first and the projection with the last. A family whose positions
depend on the span (Qwen3-Omni's thinker: 3-D M-RoPE) plugs in here once the batched decode
carries per-request position state.

`stepline-demo-audio` is a random-weight Phi-4-multimodal built on first use, with the demo
tokenizer, for tests and for trying audio offline.

mlx-vlm is imported only here (and in `engine/vision/`, `engine/omni.py`), and this module
only when an audio model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from stepline.engine import demo_files
from stepline.engine.audio import AudioData
from stepline.engine.demo_files import AUDIO_DEMO
from stepline.engine.vision.parts import EncodeJob, Expanded

_DEMO_BUILD_VERSION = 1

AUDIO_TOKEN = "<|endoftext11|>"  # Phi-4-multimodal's audio placeholder token (its processor's)


class Phi4mmAudio:
    """Phi-4-multimodal: a clip (16 kHz mono) becomes log-mel features (80 bins, 10 ms hop),
    which the Conformer subsamples 8-fold: one placeholder token per 80 ms of audio (a 10 s
    clip is 125 tokens). The span is the run of placeholders, as mlx-vlm's processor expands
    `<|audio_1|>`; its encoder's work is one unit per Conformer block."""

    rate = 16_000  # the feature extractor's sample rate
    # The span goes in one chunk, as an omni thinker's sentinel-wrapped audio must. Phi-4's
    # text model attends to its audio tokens causally at 1-D positions, so chunking them
    # would be exact too (benchmarks/audio_bench.py --chunked-span measures what it saves).
    atomic = True

    def __init__(self, config: dict[str, Any]):
        from mlx_vlm.models.phi4mm.processing_phi4mm import Phi4MMAudioFeatureExtractor

        audio = (config.get("audio_processor") or {}).get("config", {})
        self._features = Phi4MMAudioFeatureExtractor(
            audio_compression_rate=audio.get("time_reduction", 8)
        )
        self._num_blocks = int(audio.get("num_blocks", 24))
        self.placeholder = AUDIO_TOKEN  # what the chat template renders for an audio part

    def expand(self, audio: AudioData) -> Expanded:
        """The clip's span and the encoder's inputs, in numpy (no MLX off the executor)."""
        features = self._features._extract_features(audio.samples, self.rate)
        num_tokens = self._features._compute_audio_embed_size(len(features))
        inputs = {"input_audio_embeds": np.asarray(features, dtype=np.float32)[None]}
        return Expanded(AUDIO_TOKEN * num_tokens, inputs, units=self._num_blocks, whole=self.atomic)


# model_type -> how its prompts hold audio
AUDIO_FAMILIES: dict[str, type] = {"phi4mm": Phi4mmAudio}


class AudioEncoder:
    """The audio side of a loaded model, on the executor's thread: a clip's encoder work,
    unit by unit (`run`), leaving the span's input embeddings on the job."""

    def __init__(self, vlm: Any, text_model: Any):
        self.vlm = vlm
        self._dtype = text_model.model.embed_tokens.weight.dtype

    def run(self, job: EncodeJob, start: int, end: int) -> None:
        """Units [start, end) of `job`, evaluated; the span's embeddings at its last.
        Phi-4-multimodal: unit u is Conformer block u, as mlx-vlm's `ConformerEncoder` runs
        them (the normalisation, subsampling and relative-position bias before the first;
        the speech projection after the last)."""
        assert start == job.done < end <= job.units, (start, end, job.done, job.units)
        encoder, state = self.vlm.audio_encoder, job.state
        if start == 0:
            state.update(_subsampled(encoder, mx.array(job.inputs["input_audio_embeds"])))
        h = state["hidden"]
        for u in range(start, end):
            h = encoder.encoders[u](h, mask=None, relative_attention_bias=state["bias"])
        state["hidden"] = h
        if end == job.units:
            if state["pad"] is not None:  # fold the 500-frame pieces back into one clip
                h = h.reshape(state["batch"], -1, h.shape[-1])
                if state["pad"]:
                    h = h[:, : -state["pad"], :]
            features = self.vlm.audio_projection(h, mode="speech")
            job.embeddings = features[:, : job.span_ids.shape[0]].astype(self._dtype)
            state.clear()
        job.done = end
        mx.eval(job.embeddings if job.embeddings is not None else list(state.values()))


def _subsampled(encoder: Any, features: mx.array) -> dict[str, Any]:
    """The Conformer's input before its first block (mlx-vlm's `ConformerEncoder.__call__`):
    normalised, subsampled, cut into 500-frame pieces where longer, and the pieces' relative
    position bias."""
    h, _ = encoder.embed(encoder.encoder_embedding(features), None)
    max_seq_len, pad, batch = 500, None, h.shape[0]
    if h.shape[1] > max_seq_len:
        pad = (max_seq_len - h.shape[1] % max_seq_len) % max_seq_len
        if pad:
            h = mx.concatenate([h, mx.zeros((batch, pad, h.shape[2]))], axis=1)
        h = h.reshape(-1, max_seq_len, h.shape[2])
    bias = encoder.relative_attention_bias_layer(h)
    return {"hidden": h, "bias": bias, "pad": pad, "batch": batch}


def take_embeddings(model: Any) -> None:
    """Make mlx-lm's Phi-3 body (`model.model`) take `input_embeddings`, as mlx-lm's Llama
    does: a span's rows are its encoder's output, not the table's. Its class becomes a
    subclass that keeps mlx-lm's module as its own, so the engine's attention wrappers
    (`engine/forward.wrap_attention`, by the body's module) still find Phi-3's attention."""
    from mlx_lm.models import phi3
    from mlx_lm.models.base import create_attention_mask

    body = model.model
    if not isinstance(body, phi3.Phi3Model) or "input_embeddings" in type(body).__dict__:
        return

    def __call__(self: Any, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask, c)
        return self.norm(h)

    def call_model(self: Any, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        out = self.model(inputs, cache, input_embeddings=input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    names = {"__module__": phi3.__name__, "input_embeddings": True}
    body.__class__ = type("Phi3Model", (phi3.Phi3Model,), {**names, "__call__": __call__})
    model.__class__ = type("Model", (phi3.Model,), {**names, "__call__": call_model})


# -- the demo -------------------------------------------------------------------


def demo_path(cache_dir: str | Path | None = None) -> Path:
    """The directory of `stepline-demo-audio`, built there on first use."""
    return demo_files.multimodal_demo_path(
        AUDIO_DEMO, _DEMO_BUILD_VERSION, _DEMO, _build_demo, cache_dir
    )


# The demo's shape: the text demo's 2-layer size as Phi-3 (fused qkv, partial rotary), a
# 3-block Conformer of width 32, a 1-layer SigLIP2 vision tower (mlx-vlm builds one; stepline
# does not serve Phi-4-multimodal's images yet).
_DEMO = {
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "tie_word_embeddings": False,  # Phi-4's is tied; a random tied head echoes its input
    },
    "vision": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "patch_size": 14,
        "image_size": 56,
    },
    "audio": {
        "attention_dim": 32,
        "attention_heads": 2,
        "num_blocks": 3,
        "linear_units": 64,
        "input_size": 80,
        "time_reduction": 8,
        "ext_pw_out_channel": 32,
        "depthwise_seperable_out_channel": 32,
        "conv_channels": 32,
    },
    "seed": 7,
    "init_std": 0.05,
}


def _build_demo(out: Path) -> None:
    build_phi4mm(out, _DEMO)


def build_phi4mm(out: Path, shape: dict[str, Any]) -> None:
    """A random-weight Phi-4-multimodal checkpoint of `shape` (`_DEMO`'s keys) at `out`, with
    the demo tokenizer, its ChatML template rendering an audio part as the audio token. The
    audio token's id is the demo vocabulary's next (mlx-vlm's processor hard-codes Phi-4's
    200011; its model reads `audio_token_index` from the config)."""
    from transformers import PreTrainedTokenizerFast

    from stepline.engine.vision.demos import DEMO_EOS, save_demo

    (out / "tokenizer.json").write_text(demo_files.train_tokenizer_json(1024), encoding="utf-8")
    max_context = shape["text"]["max_position_embeddings"]
    for filename, content in demo_files.tokenizer_files(max_context).items():
        (out / filename).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    tokenizer.add_tokens([AUDIO_TOKEN], special_tokens=True)
    tokenizer.chat_template = demo_files.CHAT_TEMPLATE.replace(
        "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        f"{{%- elif part['type'] == 'audio' %}}{{{{- '{AUDIO_TOKEN}' }}}}{{%- endif %}}",
    )
    tokenizer.save_pretrained(str(out))
    vocab = len(tokenizer)
    audio_id = tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    config = {
        "model_type": "phi4mm",
        **shape["text"],
        "vocab_size": vocab,
        "audio_token_index": audio_id,
        "mm_hidden_size": shape["vision"]["hidden_size"],
        "vision_config": dict(shape["vision"]),
        "audio_processor": {"name": "cascades", "config": dict(shape["audio"])},
        "eos_token_id": DEMO_EOS,
        "torch_dtype": "float32",
    }
    save_demo(out, config, shape, "language_model.lm_head.weight", mx.array([audio_id]))
