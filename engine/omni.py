"""Qwen3-Omni's thinker through mlx-vlm (`qwen3_omni_moe`, the `vision` extra): audio and
images in one prompt, each an atomic span under 3-D M-RoPE positions. Only the thinker (its
text output); the talker, which speaks, is not served.

To the text model (mlx-lm's Qwen3-MoE on the thinker's own weight arrays, its ropes mlx-vlm's
interleaved M-RoPE: `engine/mrope.py`) a clip is `<|audio_start|>`, one `<|audio_pad|>` per
encoder frame, `<|audio_end|>`; an image is `<|vision_start|>`, one `<|image_pad|>` per 2x2
merged patch, `<|vision_end|>`. Both spans are atomic (`whole`: their tokens go in one chunk,
deferred when a step cannot hold them), as mminf schedules the seed's thinker. Positions follow
the thinker's rules as mlx-vlm's `get_rope_index` makes them: a clip's tokens take the next
positions in all three sections, as text does; an image's take its grid's (t, h, w) from
where the text stood, and what follows goes on from the largest plus one.

The encoders' work comes in units a step runs some of:
- audio (`OmniAudioEncoder`): one unit per window of the audio tower's convolutional front
  end (100 feature frames, a second of the clip), then one per layer of the tower over the
  whole clip (its windowed attention as the tower runs it), the projection with the last:
  units of like cost whatever the clip's length (with the whole front end in the first
  layer's unit, a 10 s clip's first unit cost ten layers' time on the demo, and the steps
  that ran it took 2-4x what the cost model, pricing units of a 1 s clip, predicted);
- images (`engine/vision/qwen_vl.QwenVLEncoder`, Qwen3-VL's own): one unit per block of
  the vision tower, its deepstack features kept with the span and added by the first text
  layers; the prompts' 3-D positions are its too (clips placed as text).

`stepline-demo-omni` is a random-weight thinker built on first use, with the demo tokenizer.
mlx-vlm is imported only here (and in `engine/vision/`, `engine/audio_model.py`), and this
module only when an omni model is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from stepline.engine import demo_files, mrope
from stepline.engine.audio import AudioData
from stepline.engine.demo_files import OMNI_DEMO
from stepline.engine.vision.parts import (
    EncodeJob,
    Expanded,
    VisionCheckpoint,
    VisionParts,
    scattered,
)
from stepline.engine.vision.qwen_vl import QwenVLEncoder, QwenVLImages

_DEMO_BUILD_VERSION = 1

OMNI_TYPES = frozenset({"qwen3_omni_moe"})  # config.json model_types served here
AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"


def is_omni(config: Mapping[str, Any]) -> bool:
    """Whether a config.json is an omni checkpoint served here (its media under
    `thinker_config`, not at the top as a vision-language model's)."""
    return config.get("model_type") in OMNI_TYPES and isinstance(config.get("thinker_config"), dict)


def audio_tokens(mel_frames: int) -> int:
    """The audio tower's frames for a clip of `mel_frames` 10 ms feature frames (its three
    stride-2 convolutions over windows of 100 frames: 13 a second)."""
    leave = mel_frames % 100
    if leave == 0:
        return mel_frames // 100 * 13
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + mel_frames // 100 * 13


class OmniAudio:
    """A clip (16 kHz mono) becomes Whisper-style log-mel features (the processor's feature
    extractor: 128 bins, 10 ms hop), which the audio tower reduces to 13 frames a second, one
    `<|audio_pad|>` token each, between `<|audio_start|>` and `<|audio_end|>` (a 10 s clip is
    132 tokens). The features are the clip's own length (no padding to 30 s, and no cut at
    30 s either: mlx-vlm's processor cuts longer clips, which the engine's audio limit
    allows up to `max_audio_seconds`)."""

    rate = 16_000
    atomic = True  # the seed's thinker keeps its sentinel-wrapped spans whole

    def __init__(self, feature_extractor: Any, num_layers: int, window: int):
        self._features = whole_clip_features(feature_extractor)
        self.rate = int(getattr(feature_extractor, "sampling_rate", self.rate))
        self._num_layers = num_layers
        self._window = window  # feature frames a window of the tower's front end reads
        self.placeholder = f"{AUDIO_START}{AUDIO_PAD}{AUDIO_END}"  # the template's audio part

    def expand(self, audio: AudioData) -> Expanded:
        """The clip's span and the audio tower's inputs, in numpy (as mlx-vlm's processor
        makes them: its feature lengths from the attention mask)."""
        out = self._features(
            audio.samples,
            sampling_rate=self.rate,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="np",
        )
        features = np.asarray(out["input_features"], dtype=np.float32)  # (1, mel, T)
        mask = np.asarray(out["attention_mask"])
        frames = int(mask.sum())
        if mask.shape[-1] > features.shape[-1]:  # a sample-domain mask: to feature frames
            frames //= mask.shape[-1] // features.shape[-1]
        count = audio_tokens(frames)
        inputs = {"input_features": features[0, :, :frames], "num_frames": np.int32(frames)}
        text = f"{AUDIO_START}{AUDIO_PAD * count}{AUDIO_END}"
        units = len(window_lengths(frames, self._window)) + self._num_layers
        return Expanded(text, inputs, units=units, whole=self.atomic)


def whole_clip_features(extractor: Any) -> Any:
    """`extractor`, its log-mel made for a whole clip in a few numpy calls (`log_mel`) where
    it is transformers' `WhisperFeatureExtractor` without dither (Qwen3-Omni's): the same
    bits. Its own `spectrogram` loops in Python over every 10 ms frame, holding the GIL
    ~200 ms for a 10 s clip on a busy 2-core CPU (the request's worker thread) while the
    streams beside it wait for the step loop; the whole-clip FFT releases it."""
    from transformers import WhisperFeatureExtractor

    if type(extractor) is WhisperFeatureExtractor and not extractor.dither:
        extractor._np_extract_fbank_features = functools.partial(log_mel, extractor)
    return extractor


def log_mel(extractor: Any, waveforms: np.ndarray, device: str = "cpu") -> np.ndarray:
    """Whisper's log-mel of each of `waveforms` (B, N), as `WhisperFeatureExtractor.
    _np_extract_fbank_features` makes it (its `spectrogram`: frames centred by reflection,
    a Hann window, float64 FFTs kept as complex64, power, the mel filters, log10; then the
    last frame dropped, clamped to 8 below the peak, scaled), all frames in one FFT."""
    n_fft, hop = extractor.n_fft, extractor.hop_length
    from transformers.audio_utils import window_function

    window = window_function(n_fft, "hann").astype(np.float64)
    out = []
    for waveform in waveforms:
        padded = np.pad(waveform, [(n_fft // 2, n_fft // 2)], mode="reflect").astype(np.float64)
        frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop]
        spectrum = np.fft.rfft(frames * window, axis=-1).astype(np.complex64)
        power = np.abs(spectrum, dtype=np.float64) ** 2.0
        mel = np.maximum(1e-10, np.dot(extractor.mel_filters.T, power.T))
        log_spec = np.log10(mel).astype(np.float32)[:, :-1]
        log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
        out.append((log_spec + 4.0) / 4.0)
    return np.array(out)


class OmniImages(QwenVLImages):
    """The thinker's images: Qwen3-VL's processing (16-pixel patches merged 2x2), the span
    kept whole as the thinker's audio is."""

    def expand(self, image: Any) -> Expanded:
        return dataclasses.replace(super().expand(image), whole=True)


class OmniAudioEncoder:
    """The thinker's audio tower in units (executor thread only): first its convolutional
    front end a window a unit (`window_lengths`), then a layer a unit, the projection with
    the last."""

    def __init__(self, thinker: Any, text_model: Any):
        self._tower = thinker.audio_tower
        self._embed_tokens = text_model.model.embed_tokens
        self._audio_id = thinker.config.audio_token_id

    def run(self, job: EncodeJob, start: int, end: int) -> None:
        """Units [start, end) of `job`, evaluated: unit u < W (the clip's W windows) is
        window u through the front end, and with the last window the windows' frames
        become the layers' input; unit W + l is layer l of the tower (the projection after
        the last, as mlx-vlm's `AudioModel.__call__` runs them); the span's embeddings at
        the last."""
        assert start == job.done < end <= job.units, (start, end, job.done, job.units)
        tower, state = self._tower, job.state
        num_frames = int(job.inputs["num_frames"])
        lengths = window_lengths(num_frames, tower.n_window * 2)
        num_windows = len(lengths)
        assert job.units == num_windows + len(tower.layers), (job.units, num_windows)
        if start == 0:
            state["features"] = mx.array(job.inputs["input_features"])
            state["windows"] = []
        for u in range(start, end):
            if u < num_windows:
                state["windows"].append(_audio_window(tower, state["features"], lengths, u))
                if u == num_windows - 1:
                    windows = state.pop("windows")
                    del state["features"]
                    state.update(_audio_frames(tower, windows, lengths, num_frames))
            else:
                layer = tower.layers[u - num_windows]
                state["hidden"] = layer(state["hidden"], state["cu_seqlens"])
        if end == job.units:
            h = state["hidden"]
            h = tower.proj2(tower.act(tower.proj1(tower.ln_post(h))))
            ids = job.span_ids[None]
            embeds = self._embed_tokens(ids)
            mask = ids == self._audio_id
            count = int(mask.sum().item())
            if h.shape[0] > count:  # as mlx-vlm's thinker fits the frames to the tokens
                h = h[:count]
            elif h.shape[0] < count:
                h = mx.concatenate([h, mx.zeros((count - h.shape[0], h.shape[1]), h.dtype)])
            job.embeddings = scattered(embeds, mask, h.astype(embeds.dtype))
            state.clear()
        job.done = end
        mx.eval(job.embeddings if job.embeddings is not None else list(state.values()))


def window_lengths(num_frames: int, window: int) -> list[int]:
    """The feature frames of each window the audio tower's front end reads (`window`: its
    `2 * n_window`), as mlx-vlm's `AudioModel.__call__` cuts a clip of `num_frames`."""
    lengths = [window] * (num_frames // window)
    if num_frames % window:
        lengths.append(num_frames % window)
    return lengths


def _audio_window(tower: Any, features: mx.array, lengths: list[int], i: int) -> mx.array:
    """Window `i` of the features (mel, T) through the front end's three convolutions, padded
    to the longest window as mlx-vlm pads every window of its batch: (1, H, W, C)."""
    import mlx.nn as nn

    at, n = sum(lengths[:i]), lengths[i]
    padded = mx.zeros((1, tower.num_mel_bins, max(lengths)), dtype=features.dtype)
    padded[0, :, :n] = features[:, at : at + n]
    h = nn.gelu(tower.conv2d1(padded[:, :, :, None]))
    h = nn.gelu(tower.conv2d2(h))
    return nn.gelu(tower.conv2d3(h))


def _audio_frames(
    tower: Any, windows: list[mx.array], lengths: list[int], num_frames: int
) -> dict[str, Any]:
    """What every layer of the audio tower reads (mlx-vlm's `AudioModel.__call__` before its
    layers), from the front end's `windows` (`_audio_window`'s): their valid frames with
    the sinusoid positions added, and the attention windows' bounds (`n_window_infer`
    frames of features each)."""
    h = mx.concatenate(windows, axis=0)
    b, height, width, c = h.shape
    h = tower.conv_out(h.transpose(0, 2, 3, 1).reshape(b, width, c * height))
    seq_len = h.shape[1]
    h = h + tower.positional_embedding(seq_len)[None]
    after = [audio_tokens(n) for n in lengths]
    rows = [i * seq_len + j for i, n in enumerate(after) for j in range(n)]
    hidden = mx.take(h.reshape(-1, h.shape[-1]), mx.array(np.array(rows, dtype=np.int32)), axis=0)
    window = max(after) * (tower.n_window_infer // (tower.n_window * 2))
    total = audio_tokens(num_frames)
    bounds = [window] * (total // window) + ([total % window] if total % window else [])
    cu_seqlens = mx.pad(mx.cumsum(mx.array(bounds, dtype=mx.int32), axis=0), (1, 0))
    return {"hidden": hidden, "cu_seqlens": cu_seqlens}


def load_omni(path: Path, config: dict[str, Any], fit: Any) -> VisionCheckpoint:
    """The thinker of the omni checkpoint at `path`: its text model (mlx-lm's Qwen3-MoE on
    its weights, its ropes mlx-vlm's), tokenizer, and both media's prompt sides and
    encoders. Raises VisionUnavailableError as `vision.load.load_vision` does."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm
    from mlx_vlm.utils import load_processor

    from stepline.engine.vision.text_model import text_model

    vlm = load_vlm(path)
    weights = fit(vlm)
    processor = load_processor(path, add_detokenizer=False)
    thinker = vlm.thinker
    eos = config.get("eos_token_id") or config["thinker_config"]["text_config"].get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tokenizer = load_tokenizer(path, eos_token_ids=sorted(set(eos_ids)) or None)
    text_config = dataclasses.asdict(thinker.config.text_config)
    text_config = {**text_config, **config["thinker_config"]["text_config"]}
    text_config["model_type"] = "qwen3_moe"
    quantized = {k: config[k] for k in ("quantization", "quantization_config") if k in config}
    top = {"model_type": config["model_type"], "text_config": text_config, **quantized}
    text = text_model(vlm, top)
    mrope.install(text, thinker)
    parts = VisionParts(
        config["model_type"],
        QwenVLEncoder(thinker, text, image_id=thinker.config.image_token_id),
        images=OmniImages(processor, thinker.config.vision_config.depth),
        audio=OmniAudio(
            processor.feature_extractor,
            len(thinker.audio_tower.layers),
            window=thinker.audio_tower.n_window * 2,
        ),
        audio_encoder=OmniAudioEncoder(thinker, text),
    )
    return VisionCheckpoint(text_model=text, tokenizer=tokenizer, parts=parts, weights=weights)


# -- the demo -------------------------------------------------------------------


def demo_path(cache_dir: str | Path | None = None) -> Path:
    """The directory of `stepline-demo-omni`, built there on first use."""
    return demo_files.multimodal_demo_path(
        OMNI_DEMO, _DEMO_BUILD_VERSION, _DEMO, _build_demo, cache_dir
    )


# The demo's shape: a 2-layer Qwen3-MoE text model of the text demo's width (4 experts, 2 a
# token; interleaved M-RoPE sections 4/6/6 of 32-wide heads); a 2-layer audio tower of
# width 32 over 128 mel bins (13 tokens a second); a 3-block Qwen3-VL vision tower (a
# deepstack feature after its first block) reading 8-pixel patches merged 2x2: an image of
# up to 96x96 pixels is up to 36 tokens.
_DEMO: dict[str, Any] = {
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "default", "mrope_section": [4, 6, 6], "interleaved": True},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "audio": {
        "d_model": 32,
        "encoder_layers": 2,
        "num_hidden_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "num_mel_bins": 128,
        "output_dim": 64,
        "downsample_hidden_size": 8,
        "n_window": 50,
        "n_window_infer": 400,
        "max_source_positions": 1500,
    },
    "vision": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 144,
        "deepstack_visual_indexes": [0],
        "in_channels": 3,
        "in_chans": 3,
    },
    "min_pixels": 16 * 16,
    "max_pixels": 96 * 96,
    "seed": 11,
    "init_std": 0.08,
}
OMNI_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, AUDIO_START, AUDIO_END, AUDIO_PAD)


def _build_demo(out: Path) -> None:
    build_qwen3_omni(out, _DEMO)


def build_qwen3_omni(out: Path, shape: Mapping[str, Any]) -> None:
    """A random-weight Qwen3-Omni checkpoint of `shape` (`_DEMO`'s keys) at `out`, thinker
    only (no talker), with the demo tokenizer, Qwen3-Omni's media tokens added and a chat
    template that renders an image part and an audio part as Qwen3-Omni's does."""
    from tokenizers import Tokenizer

    from stepline.engine.vision.demos import DEMO_EOS, save_demo

    tokenizer = Tokenizer.from_str(demo_files.train_tokenizer_json(1024))
    tokenizer.add_special_tokens(list(OMNI_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: int(tokenizer.token_to_id(t)) for t in OMNI_TOKENS}
    template = demo_files.CHAT_TEMPLATE.replace(
        "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        f"{{%- elif part['type'] == 'image' %}}{{{{- '{VISION_START}{IMAGE_PAD}{VISION_END}' }}}}"
        f"{{%- elif part['type'] == 'audio' %}}{{{{- '{AUDIO_START}{AUDIO_PAD}{AUDIO_END}' }}}}"
        "{%- endif %}",
    )
    files = demo_files.tokenizer_files(shape["text"]["max_position_embeddings"])
    files["tokenizer_config.json"]["chat_template"] = template
    files["tokenizer_config.json"]["extra_special_tokens"] = {
        "image_token": IMAGE_PAD,
        "video_token": VIDEO_PAD,
        "audio_token": AUDIO_PAD,
        "vision_bos_token": VISION_START,
        "vision_eos_token": VISION_END,
        "audio_bos_token": AUDIO_START,
        "audio_eos_token": AUDIO_END,
    }
    for filename, content in files.items():
        (out / filename).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    vision = shape["vision"]
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": shape["audio"]["num_mel_bins"],
        "sampling_rate": 16_000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3OmniMoeProcessor",
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "min_pixels": shape["min_pixels"],
        "max_pixels": shape["max_pixels"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    vocab = tokenizer.get_vocab_size()
    thinker = {
        "model_type": "qwen3_omni_moe_thinker",
        "text_config": {**shape["text"], "vocab_size": vocab, "model_type": "qwen3_omni_moe_text"},
        "audio_config": dict(shape["audio"]),
        "vision_config": dict(vision),
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "audio_token_id": ids[AUDIO_PAD],
        "audio_start_token_id": ids[AUDIO_START],
        "audio_end_token_id": ids[AUDIO_END],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
    }
    config = {
        "model_type": "qwen3_omni_moe",
        "enable_audio_output": False,  # the thinker only: no talker, no code2wav
        "thinker_config": thinker,
        # mlx-vlm's config reads one (the talker is not built: `enable_audio_output`)
        "talker_config": {"text_config": thinker["text_config"]},
        "eos_token_id": DEMO_EOS,
        "im_start_token_id": demo_files.SPECIAL_TOKENS.index(demo_files.IM_START),
        "im_end_token_id": demo_files.SPECIAL_TOKENS.index(demo_files.IM_END),
        "torch_dtype": "float32",
    }
    media_ids = mx.arange(min(ids.values()), vocab)  # the media tokens
    save_demo(out, config, shape, "thinker.language_model.lm_head.weight", media_ids)
