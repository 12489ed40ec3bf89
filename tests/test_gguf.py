"""GGUF files load as the models they were written from: names, llama's rope layout, the
tokenizer, quantized and K-quant tensors, Llama 3's rope scaling, the conversion cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf_files import gguf_name, random_model, roundtrip, tokenizer_metadata, write_gguf
from helpers import small_config
from mlx.utils import tree_flatten, tree_unflatten

from stepline.engine.gguf import GGUFError, gguf_model_dir
from stepline.engine.models import load_model

Q = GGMLQuantizationType
TEXT = "The bread of 1984, baked at 220 degrees: <|im_end|> isn't it?"


def logits(model, ids: list[int]) -> mx.array:
    return model(mx.array(ids)[None])[0].astype(mx.float32)


@pytest.fixture(scope="module")
def vocab(demo) -> dict:
    return tokenizer_metadata(demo.path)


def test_a_llama_gguf_gives_the_logits_tokens_and_template_of_its_model(demo, vocab, tmp_path):
    config = json.loads((demo.path / "config.json").read_text())
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    path = write_gguf(
        tmp_path / "demo.gguf", "llama", demo.model, config, vocab, chat_template=template
    )
    loaded = load_model(str(path), dtype="keep")
    assert loaded.name == "demo"
    ids = demo.tokenizer.encode(TEXT)
    assert loaded.tokenizer.encode(TEXT) == ids  # digits, specials, byte-level BPE
    assert loaded.tokenizer.decode(ids) == TEXT
    assert loaded.tokenizer.eos_token_ids == {2}
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert loaded.tokenizer.decode(chat) == "<|im_start|>hi<|im_end|>"
    assert mx.allclose(logits(loaded.model, ids), logits(demo.model, ids), atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_ggufs_give_the_logits_of_their_model(arch, vocab, tmp_path):
    config = small_config(vocab_size=len(vocab["tokens"]), tie_word_embeddings=True)
    if arch == "qwen3":
        config["head_dim"] = 16
    model = random_model(arch, config, seed=7)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, model, config, vocab, pre="qwen2")
    loaded = load_model(str(path), dtype="keep")
    assert type(loaded.model).__module__ == f"mlx_lm.models.{arch}"
    ids = loaded.tokenizer.encode(TEXT)
    assert mx.allclose(logits(loaded.model, ids), logits(model, ids), atol=1e-5)


@pytest.mark.parametrize(
    "kind,kept_bits",
    [(Q.Q8_0, 8), (Q.Q4_0, 4), (Q.Q4_1, 4), (Q.Q5_0, None)],
    ids=["Q8_0", "Q4_0", "Q4_1", "Q5_0"],
)
def test_quantized_tensors_read_as_llama_cpps_reference_reads_them(
    demo, vocab, kind, kept_bits, tmp_path
):
    config = json.loads((demo.path / "config.json").read_text())
    matrices = {n for n, v in tree_flatten(demo.model.parameters()) if v.ndim == 2}
    path = write_gguf(
        tmp_path / "q.gguf",
        "llama",
        demo.model,
        config,
        vocab,
        types=dict.fromkeys(matrices, kind),
    )
    loaded = load_model(str(path), dtype="keep")
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    # MLX keeps the 4/8-bit kinds quantized; other kinds are dequantized to float16.
    assert getattr(q_proj, "bits", None) == kept_bits
    # The reference: the source model with every matrix as the gguf package reads it back.
    reference = random_model("llama", config, seed=0)
    reference.update(
        tree_unflatten(
            [
                (n, mx.array(roundtrip(np.array(v), kind)) if n in matrices else v)
                for n, v in tree_flatten(demo.model.parameters())
            ]
        )
    )
    ids = demo.tokenizer.encode(TEXT)
    expected = logits(reference, ids)
    assert mx.allclose(logits(loaded.model, ids), expected, atol=2e-3)
    # Dequantized for the CPU backend, the same numbers.
    auto = load_model(str(path))
    assert auto.weights.startswith("float32")
    assert mx.allclose(logits(auto.model, ids), expected, atol=2e-3)


def k_quant_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant type with sane float16 scales."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if kind == Q.Q6_K:  # ql, qh, 16 int8 scales, then d
        data[..., -2:] = scale
    else:  # Q4_K: d, dmin, 12 bytes of scales, qs
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, -1)


def test_k_quant_tensors_are_dequantized_as_llama_cpp_reads_them(vocab, tmp_path):
    config = small_config(
        hidden_size=256, intermediate_size=256, vocab_size=len(vocab["tokens"]), head_dim=64
    )
    model = random_model("llama", config, seed=3)
    up, down = k_quant_blocks(Q.Q4_K, 256, 256, 1), k_quant_blocks(Q.Q6_K, 256, 256, 2)
    path = write_gguf(
        tmp_path / "k.gguf",
        "llama",
        model,
        config,
        vocab,
        raw={
            "model.layers.0.mlp.up_proj.weight": (up, Q.Q4_K),
            "model.layers.0.mlp.down_proj.weight": (down, Q.Q6_K),
        },
    )
    loaded = load_model(str(path), dtype="keep")
    mlp = loaded.model.model.layers[0].mlp
    for layer, blocks, kind in ((mlp.up_proj, up, Q.Q4_K), (mlp.down_proj, down, Q.Q6_K)):
        expected = gguf.quants.dequantize(blocks, kind).astype(np.float16)
        assert np.array_equal(np.array(layer.weight), expected)
    # The other tensors of such a file: float16, the numbers written.
    norm = loaded.model.model.layers[1].input_layernorm.weight
    assert mx.array_equal(norm, model.model.layers[1].input_layernorm.weight)


def test_a_tensor_type_no_reader_knows_is_refused_naming_the_tensor(demo, vocab, tmp_path):
    config = json.loads((demo.path / "config.json").read_text())
    blocks = np.zeros((64, 2 * GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
    path = write_gguf(
        tmp_path / "q81.gguf",
        "llama",
        demo.model,
        config,
        vocab,
        raw={"model.layers.1.mlp.gate_proj.weight": (blocks, Q.Q8_1)},
    )
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_gate\.weight has type Q8_1"):
        load_model(str(path))


def bare_gguf(path: Path, arch: str, tokenizer_model: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_or_tokenizer_is_refused_naming_it(tmp_path):
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported.*qwen3"):
        load_model(str(bare_gguf(tmp_path / "f.gguf", "falcon")))
    with pytest.raises(GGUFError, match="tokenizer model 'rwkv' is not supported"):
        load_model(str(bare_gguf(tmp_path / "w.gguf", "llama", tokenizer_model="rwkv")))


def llama3_factors(dims: int, theta: float, factor: float) -> np.ndarray:
    """The rope_freqs llama.cpp's converter writes for a Llama 3.x model."""
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, dims, 2) / dims)):
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(vocab, tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = small_config(
        vocab_size=len(vocab["tokens"]), rope_theta=500000.0, head_dim=16, rope_scaling=scaling
    )
    model = random_model("llama", config, seed=5)
    factors = llama3_factors(16, 500000.0, 32.0)
    assert factors.min() == 1.0 and factors.max() == 32.0  # every band is exercised
    path = write_gguf(tmp_path / "l3.gguf", "llama", model, config, vocab, rope_freqs=factors)
    loaded = load_model(str(path), dtype="keep")
    assert json.loads((loaded.path / "config.json").read_text())["rope_scaling"] == scaling
    ids = list(range(10, 300))  # long enough for the low frequencies to matter
    assert mx.allclose(logits(loaded.model, ids), logits(model, ids), atol=1e-4)


def test_a_converted_gguf_is_reused_until_the_file_changes(demo, vocab, tmp_path):
    config = json.loads((demo.path / "config.json").read_text())
    path = write_gguf(tmp_path / "c.gguf", "llama", demo.model, config, vocab)
    first, converted = gguf_model_dir(path, tmp_path / "cache")
    assert converted
    again, converted = gguf_model_dir(path, tmp_path / "cache")
    assert (again, converted) == (first, False)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed, converted = gguf_model_dir(path, tmp_path / "cache")
    assert converted and changed != first


def sentencepiece_gguf(tmp_path: Path):
    """A llama GGUF whose tokenizer is a SentencePiece BPE trained here, stored the way
    llama.cpp's converter stores one; returns (path, the SentencePiece processor)."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(Path(__file__).parents[1] / "engine" / "demo_corpus.txt"),
        model_writer=proto,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        # As Llama 2's and Mistral's models: text as it is, spaces kept.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    size = sp.get_piece_size()
    kinds = []
    for i in range(size):
        if sp.is_unknown(i):
            kinds.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            kinds.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            kinds.append(gguf.TokenType.BYTE)
        else:
            kinds.append(gguf.TokenType.NORMAL)
    config = small_config(vocab_size=size)
    model = random_model("llama", config, seed=11)
    path = tmp_path / "sp.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(size)])
    writer.add_token_scores([sp.get_score(i) for i in range(size)])
    writer.add_token_types(kinds)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    for name, value in tree_flatten(model.parameters()):
        writer.add_tensor(gguf_name(name), np.array(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, sp


def test_a_sentencepiece_tokenizer_encodes_and_decodes_as_sentencepiece_does(tmp_path):
    path, sp = sentencepiece_gguf(tmp_path)
    loaded = load_model(str(path), dtype="keep")
    texts = [
        "The bread of 1984 was baked at 220 degrees.",
        "  two leading spaces, and\nnew lines\n\nand tabs\there",
        "Unicode the corpus never saw: Zürich, naïve, 東京, 🍞!",
        "wordswithoutspaces and CAPITALS",
    ]
    for text in texts:
        ids = loaded.tokenizer.encode(text)
        assert ids == [1, *sp.encode(text)], text  # <s> first, as add_bos_token says
        assert loaded.tokenizer.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:])
    assert loaded.tokenizer.eos_token_ids == {2}
