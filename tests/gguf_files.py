"""GGUF files written the way llama.cpp's converter writes them, from small mlx-lm models.

The tests load them back through stepline and compare with the model they came from. The
names, the q/k row interleaving of llama and the metadata keys here are the file format's
(what llama.cpp's `convert_hf_to_gguf.py` produces), written independently of
`stepline.engine.gguf`, which reads them.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf.constants import GGMLQuantizationType
from mlx.utils import tree_flatten, tree_unflatten

_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    module, _, leaf = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, part = module.split(".", 3)
        return f"blk.{layer}.{_BLOCK[part]}.{leaf}"
    return f"{_GLOBAL[module]}.{leaf}"


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of llama's q/k rows (Hugging Face halves -> neighbours)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def random_model(arch: str, config: dict[str, Any], seed: int) -> Any:
    """A seeded random mlx-lm model of `arch` (weights N(0, 0.05), norms ~1)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": arch, **config}))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, value), key in zip(params, keys, strict=True):
        if "norm" in name:
            new.append((name, 1.0 + 0.1 * mx.random.normal(value.shape, key=key)))
        else:
            new.append((name, 0.05 * mx.random.normal(value.shape, key=key)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


def tokenizer_metadata(tokenizer_dir: Path) -> dict[str, Any]:
    """Tokens, types and merges of a byte-level BPE tokenizer.json, as GGUF stores them."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for added in data["added_tokens"]:
        kind = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        types[added["id"]] = kind
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(
    path: Path,
    arch: str,
    model: Any,
    config: dict[str, Any],
    tokenizer: dict[str, Any],
    *,
    pre: str = "gpt-2",
    eos_token_id: int = 2,
    chat_template: str | None = None,
    types: dict[str, GGMLQuantizationType] | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """Write `model` as a GGUF file. `types` quantizes 2-D weights (by HF name; default F32)
    with the gguf package; `raw` replaces a tensor with given blocks of a given type."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_eos_token_id(eos_token_id)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    types, raw = types or {}, raw or {}
    for hf_name, value in tree_flatten(model.parameters()):
        name = gguf_name(hf_name)
        if hf_name in raw:
            blocks, kind = raw[hf_name]
            writer.add_tensor(name, blocks, raw_dtype=kind)
            continue
        array = np.array(value.astype(mx.float32))
        if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            array = interleave(array, heads if "q_proj" in hf_name else kv_heads)
        kind = types.get(hf_name, GGMLQuantizationType.F32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def roundtrip(array: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """What a reader must get back from `array` stored as `kind` (the gguf package's own
    dequantizer: llama.cpp's reference)."""
    return gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind)
