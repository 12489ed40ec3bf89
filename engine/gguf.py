"""GGUF files (llama.cpp's format, what Ollama and LM Studio users have) as mlx-lm models.

A GGUF file holds a model's weights, its tokenizer and its chat template. `gguf_model_dir`
converts one into an mlx-lm directory (config.json, safetensors, tokenizer.json,
tokenizer_config.json) in stepline's cache, keyed by the file's path, size and mtime, so
only the first load converts; every load then goes through `mlx_lm.load` like any model.

Covered:
- architectures (GGUF `general.architecture`): llama (and the models converted as llama:
  SmolLM, Mistral, Llama 3.x with its `rope_freqs`), qwen2, qwen3;
- tokenizers: byte-level BPE (`tokenizer.ggml.model = gpt2`) with the pre-tokenizers in
  `_PRE_TOKENIZERS` (SmolLM, GPT-2, Qwen2/3, Llama 3), and SentencePiece BPE (`llama`:
  Llama 2, Mistral, TinyLlama); others are refused, naming what is missing;
- tensors: F32, F16, BF16, Q4_0, Q4_1 and Q8_0 are read by MLX itself, and the quantized
  ones stay quantized as MLX 4/8-bit arrays of group size 32 (the same numbers); a file with
  any other type (the K-quants of Q4_K_M and Q6_K files, Q5_0, IQ4_NL, ...) is dequantized
  tensor by tensor to float16 with the `gguf` package, llama.cpp's own reader. Types that
  neither reads are refused, naming the tensor and its type.

llama.cpp's converter stores llama's q/k projection rows interleaved for its rope; they are
put back in Hugging Face order here, so the directory is a plain mlx-lm llama.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog

from stepline.engine.cache_dirs import GGUF_SOURCE_FILE, build_once

log = structlog.get_logger(__name__)

# Bump when the conversion changes, so directories converted by an older stepline are redone.
_CONVERT_VERSION = 1


class GGUFError(ValueError):
    """A GGUF file stepline cannot serve; the message says what is unsupported and why."""


# GGUF architecture -> mlx-lm model_type.
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Tensor types MLX's own GGUF reader loads (mx.load); the quantized ones as (bits) arrays.
_MLX_TYPES = {"F32": None, "F16": None, "BF16": None, "Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GROUP_SIZE = 32  # of every GGML block type MLX reads as quantized

# GGUF tensor name -> Hugging Face (mlx-lm) parameter path.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# The split patterns of llama.cpp's pre-tokenizer types, as the Hugging Face tokenizers of
# those models have them.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "qwen2", "llama-bpe", "llama3")

ProgressFn = Callable[[int, int], None]


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its magic bytes, not its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_model_dir(
    path: str | Path, cache_root: Path, progress: ProgressFn | None = None
) -> tuple[Path, bool]:
    """The mlx-lm directory of GGUF file ``path``, converting it on first use.

    Returns (directory, whether it was converted now). The directory is
    ``<cache_root>/models/gguf-<stem>-<hash of path, size, mtime>``, built next to it and
    renamed into place, so one that exists is complete. ``progress(done, total)`` is called
    as tensors are converted.

    Raises GGUFError for a file stepline cannot serve (architecture, tokenizer or tensor
    type), naming what is unsupported; OSError if the file cannot be read.
    """
    src = Path(path).expanduser().resolve()
    stat = src.stat()
    key = json.dumps([_CONVERT_VERSION, str(src), stat.st_size, stat.st_mtime_ns])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    final = cache_root / "models" / f"gguf-{src.stem}-{digest}"
    converted = build_once(final, lambda tmp: convert_gguf(src, tmp, progress))
    if not (final / GGUF_SOURCE_FILE).is_file():  # converted before stepline wrote one
        write_source(src, final)
    return final, converted


def write_source(src: Path, out: Path) -> None:
    """Write `out/GGUF_SOURCE_FILE`: GGUF file `src`'s path, size and file type (llama.cpp's
    `general.file_type`, such as Q4_1 or Q4_K_M), read from its metadata alone, so that
    model listings (Ollama's) can say what the file was."""
    from gguf import GGUFReader, LlamaFileType

    meta = _Metadata(GGUFReader(src))
    kind = meta.get("general.file_type")
    try:
        file_type = LlamaFileType(kind).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        file_type = ""  # absent, or a type newer than this gguf package
    facts = {
        "file": str(src),
        "size": src.stat().st_size,
        "file_type": file_type,
        "size_label": meta.get("general.size_label") or "",
    }
    tmp = out / f".{GGUF_SOURCE_FILE}.{time.monotonic_ns()}"
    tmp.write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / GGUF_SOURCE_FILE)


def convert_gguf(src: Path, out: Path, progress: ProgressFn | None = None) -> None:
    """Write GGUF file ``src`` as an mlx-lm model directory ``out`` (which exists).

    Raises GGUFError for what it cannot convert, before writing anything.
    """
    from gguf import GGUFReader

    reader = GGUFReader(src)
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(
            f"{src.name}: architecture {arch!r} is not supported for GGUF files yet "
            f"(supported: {', '.join(_ARCHS)}); convert the original Hugging Face model "
            "with mlx_lm.convert instead"
        )
    tensor_types = {t.name: t.tensor_type.name for t in reader.tensors}
    native = all(kind in _MLX_TYPES for kind in tensor_types.values())
    if not native:
        _check_numpy_types(src, reader)
    tokenizer_files = _tokenizer_files(src, meta)
    config = _config(src, meta, arch, tensor_types, reader)
    total = len(reader.tensors)
    started = time.monotonic()
    if native:
        weights = mx.load(str(src))
        if progress is not None:
            progress(total, total)
    else:
        weights = _dequantized(reader, progress)
    del reader
    weights, quantization = _rename(weights, tensor_types, config)
    if quantization:
        config["quantization"] = quantization
    _save_weights(weights, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for filename, content in tokenizer_files.items():
        (out / filename).write_text(content, encoding="utf-8")
    log.info(
        "gguf_converted",
        file=str(src),
        tensors=total,
        kept_quantized=bool(quantization),
        seconds=round(time.monotonic() - started, 2),
    )


class _Metadata:
    """GGUF key-value metadata, read with the gguf package."""

    def __init__(self, reader: Any):
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        return value


def _check_numpy_types(src: Path, reader: Any) -> None:
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    probed: dict[Any, bool] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind not in probed:
            block, size = GGML_QUANT_SIZES.get(kind, (1, 0))
            try:
                dequantize(np.zeros((1, max(size, 1)), dtype=np.uint8), kind)
                probed[kind] = size > 0
            except (NotImplementedError, ValueError):
                probed[kind] = False
        if not probed[kind]:
            raise GGUFError(
                f"{src.name}: tensor {tensor.name} has type {kind.name}, which neither MLX "
                "nor the gguf package can read; use a file quantized as Q4_0, Q4_1, Q8_0, "
                "Q4_K_M, Q6_K (or F16/BF16/F32)"
            )


def _dequantized(reader: Any, progress: ProgressFn | None) -> dict[str, mx.array]:
    """Every tensor as float16 (F32 tensors stay float32), dequantized with numpy."""
    from gguf.quants import dequantize

    weights: dict[str, mx.array] = {}
    total = len(reader.tensors)
    step = max(1, total // 10)
    for i, tensor in enumerate(reader.tensors, start=1):
        kind = tensor.tensor_type.name
        # GGUF lists dimensions innermost first; numpy's order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if kind == "F32":
            array = np.asarray(tensor.data, dtype=np.float32).reshape(shape)
            weights[tensor.name] = mx.array(array)
        else:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            weights[tensor.name] = mx.array(array.astype(np.float16))
        mx.eval(weights[tensor.name])
        if progress is not None and (i % step == 0 or i == total):
            progress(i, total)
    return weights


def _config(
    src: Path, meta: _Metadata, arch: str, tensor_types: dict[str, str], reader: Any
) -> dict[str, Any]:
    def arch_key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = arch_key("embedding_length")
    heads = arch_key("attention.head_count")
    layers = arch_key("block_count")
    if hidden is None or heads is None or layers is None:
        raise GGUFError(f"{src.name}: metadata lacks {arch}.embedding_length/head_count/...")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": _ARCHS[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": arch_key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": arch_key("attention.head_count_kv", heads),
        "rms_norm_eps": arch_key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": arch_key("rope.freq_base", 10000.0),
        "max_position_embeddings": arch_key("context_length", 4096),
        "vocab_size": arch_key("vocab_size") or len(tokens),
        "tie_word_embeddings": "output.weight" not in tensor_types,
        "head_dim": arch_key("attention.key_length") or hidden // heads,
        "eos_token_id": _eos_ids(meta),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_types
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_types
    rope_scaling = _rope_scaling(src, meta, arch, config, reader)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _eos_ids(meta: _Metadata) -> list[int]:
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and value not in ids:
            ids.append(int(value))
    return ids


def _rope_scaling(
    src: Path, meta: _Metadata, arch: str, config: dict[str, Any], reader: Any
) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"type": kind, "factor": float(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none"):
        raise GGUFError(f"{src.name}: rope scaling {kind!r} is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return _llama3_rope(src, np.asarray(freqs.data, dtype=np.float64), config)


def _llama3_rope(src: Path, factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.x's rope scaling, recovered from the per-frequency factors llama.cpp stores
    (`rope_freqs`): its converter computes them from these four numbers, the last three
    the same in every Llama 3.x release; the factors are checked against them."""
    dims = config["head_dim"]
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    wavelen = 2 * np.pi * config["rope_theta"] ** (np.arange(0, dims, 2) / dims)
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(
        wavelen < high,
        1.0,
        np.where(wavelen > low, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)),
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise GGUFError(
            f"{src.name}: its rope_freqs are not Llama 3's rope scaling; this rope is not "
            "supported for GGUF files yet"
        )
    return scaling


def _hf_name(gguf_name: str) -> tuple[str, str]:
    """(module path, parameter) of a GGUF tensor name, e.g. blk.3.attn_q.weight ->
    (model.layers.3.self_attn.q_proj, weight). Raises GGUFError for names it does not know."""
    base, _, leaf = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}", leaf
    elif base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base], leaf
    raise GGUFError(f"tensor {gguf_name} has no counterpart in the mlx-lm model")


def _rename(
    weights: dict[str, mx.array], tensor_types: dict[str, str], config: dict[str, Any]
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """GGUF names -> mlx-lm names, llama's q/k rows back in Hugging Face order, and the
    quantization section of config.json for the tensors that stay quantized."""
    bits_of = {name: _MLX_TYPES.get(kind) for name, kind in tensor_types.items()}
    quantized = {
        name.removesuffix(".weight"): bits
        for name, bits in bits_of.items()
        if bits is not None and name.endswith(".weight") and f"{name[:-7]}.scales" in weights
    }
    renamed: dict[str, mx.array] = {}
    quantization: dict[str, Any] = {}
    default_bits = max(set(quantized.values()), key=list(quantized.values()).count, default=0)
    for name, array in weights.items():
        if name == "rope_freqs.weight":  # turned into config["rope_scaling"]
            continue
        module, leaf = _hf_name(name)
        if config["model_type"] == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = config[
                "num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"
            ]
            array = _unpermute(array, heads)
        renamed[f"{module}.{leaf}"] = array
        gguf_base = name.rpartition(".")[0]
        bits = quantized.get(gguf_base)
        if leaf == "weight" and bits is not None and bits != default_bits:
            quantization[module] = {"group_size": _GROUP_SIZE, "bits": bits}
    if quantized:
        quantization = {"group_size": _GROUP_SIZE, "bits": default_bits, **quantization}
    return renamed, quantization


def _unpermute(array: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's interleaving of each head's rows (its rope pairs neighbours; Hugging
    Face's pairs the two halves). Rows only: a quantized weight's scales and biases too."""
    rows = array.shape[0]
    half = rows // heads // 2
    return array.reshape(heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _save_weights(weights: dict[str, mx.array], out: Path) -> None:
    from mlx_lm.utils import make_shards

    shards = make_shards(weights)
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    index: dict[str, Any] = {"metadata": {}, "weight_map": {}}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _tokenizer_files(src: Path, meta: _Metadata) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json from the GGUF's tokenizer metadata."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{src.name}: {len(tokens)} tokens but {len(types)} token types")
    vocab = {token: i for i, token in enumerate(tokens)}
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(src, meta, vocab)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, vocab, types)
    else:
        raise GGUFError(
            f"{src.name}: tokenizer model {kind!r} is not supported for GGUF files yet "
            "(supported: gpt2, the byte-level BPE of SmolLM, Qwen and Llama 3; llama, the "
            "SentencePiece BPE of Llama 2 and Mistral)"
        )
    # Control tokens (type 3) and the unknown token (2) are specials; user-defined ones
    # (4: Qwen's <think>, <tool_call>) are matched whole but are text to the decoder.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k in (2, 3)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == 4
        ]
    )

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        assert bos is not None
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        # Off, or decode() would rewrite " ." to "." and text would not round-trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{meta.get('general.architecture')}.context_length"),
    }
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
    }


def _byte_level_bpe(src: Path, meta: _Metadata, vocab: dict[str, int]) -> Any:
    """GPT-2-style byte-level BPE (SmolLM, Qwen, Llama 3), with the pre-tokenizer named."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"{src.name}: pre-tokenizer {pre!r} is not supported for GGUF files yet "
            f"(supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # each digit on its own, then GPT-2's pattern
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("qwen2", "llama-bpe", "llama3"):
        pattern = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: _Metadata, vocab: dict[str, int], types: list[int]) -> Any:
    """SentencePiece BPE (Llama 2, Mistral, TinyLlama) as Hugging Face's fast tokenizer has
    it: merges ranked by the merged piece's score, bytes the vocabulary lacks as <0xXX>
    pieces, spaces as U+2581 with one before the text."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers.tokenization_utils_base import generate_merges

    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(vocab))
    pieces = list(vocab)
    # Byte and control pieces are never merged into; their scores do not rank merges.
    ranked = {p: scores[i] for i, p in enumerate(pieces) if types[i] in (1, 4)}
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=generate_merges(vocab, ranked),
            unk_token=pieces[unknown] if unknown is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer
