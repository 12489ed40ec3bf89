"""Tiny random-weight BERT-family sentence-transformers directories, built offline for the
tests of engine/bert.py: a WordPiece tokenizer trained on the demo corpus (a BERT's: [CLS]
text [SEP], lower-cased; an XLM-RoBERTa's: <s> text </s>, its pad id 1), the encoder's
config and seeded weights in mlx-embeddings' own names, and the sentence-transformers files
(modules.json, 1_Pooling, Normalize, sentence_bert_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stepline.engine.demo_files import CORPUS_PATH, sentence_transformers_files

HIDDEN = 32
# (special tokens in id order, the post-processor's template pieces, cls, sep, pad, unk)
_SPECIALS = {
    "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS]", "[SEP]", "[PAD]", "[UNK]"),
    "xlm-roberta": (["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<s>", "</s>", "<pad>", "<unk>"),
}


def tokenizer_json(model_type: str, vocab_size: int = 600) -> str:
    """A tokenizer trained on the demo corpus, with the model family's specials: a BERT's
    WordPiece (lower-cased), an XLM-RoBERTa's SentencePiece-style Unigram."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import UnigramTrainer, WordPieceTrainer

    specials, cls, sep, _, unk = _SPECIALS[model_type]
    if model_type == "bert":
        tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer: Any = WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False
        )
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = UnigramTrainer(
            vocab_size=vocab_size, special_tokens=specials, unk_token=unk, show_progress=False
        )
    tokenizer.train_from_iterator(CORPUS_PATH.read_text("utf-8").split("\n\n"), trainer=trainer)
    ids = {t: tokenizer.token_to_id(t) for t in (cls, sep)}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", special_tokens=list(ids.items())
    )
    return tokenizer.to_str()


def build_bert_dir(
    out: Path,
    *,
    model_type: str = "bert",
    pooling: str = "mean",
    normalize: bool = True,
    positions: int = 64,
    max_seq_length: int | None = None,
    seed: int = 0,
    shape: tuple[int, int, int, int] = (HIDDEN, 2, 4, 64),
) -> Path:
    """A `model_type` encoder at `out` (`shape`: width, layers, heads, MLP width; tiny by
    default, all-MiniLM-L6-v2's (384, 6, 12, 1536) for benchmarks), pooled as `pooling`
    says."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_embeddings.models import bert, xlm_roberta

    out.mkdir(parents=True, exist_ok=True)
    specials, cls, sep, pad, unk = _SPECIALS[model_type]
    from tokenizers import Tokenizer

    text = tokenizer_json(model_type)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    trained = Tokenizer.from_str(text)
    pad_id = trained.token_to_id(pad)
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": ["BertModel" if model_type == "bert" else "XLMRobertaModel"],
        "hidden_size": shape[0],
        "num_hidden_layers": shape[1],
        "num_attention_heads": shape[2],
        "intermediate_size": shape[3],
        "hidden_act": "gelu",
        # XLM-RoBERTa's positions start past its pad id: 2 more for the same input length
        "max_position_embeddings": positions + (pad_id + 1 if model_type != "bert" else 0),
        "type_vocab_size": 2 if model_type == "bert" else 1,
        "vocab_size": trained.get_vocab_size(),
        "layer_norm_eps": 1e-12 if model_type == "bert" else 1e-5,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    arch = bert if model_type == "bert" else xlm_roberta
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(params))
    std = 0.2 if shape[0] <= HIDDEN else 0.05
    new = {}
    for key, name in zip(keys, sorted(params), strict=True):
        dims = params[name].shape
        if "LayerNorm" in name:  # a real LayerNorm's scale and shift, not random
            value = mx.ones(dims) if name.endswith("weight") else mx.zeros(dims)
        else:
            value = std * mx.random.normal(dims, key=key)
        new[name] = value.astype(mx.float32)
    model.update(tree_unflatten(list(new.items())))
    mx.save_safetensors(str(out / "model.safetensors"), new, metadata={"format": "mlx"})
    tokens = {"cls_token": cls, "sep_token": sep, "pad_token": pad, "unk_token": unk}
    tokens["mask_token"] = specials[4]
    tokenizer_config = {
        "tokenizer_class": "BertTokenizer" if model_type == "bert" else "XLMRobertaTokenizer",
        "model_max_length": positions,
        "do_lower_case": model_type == "bert",
        **tokens,
    }
    files: dict[str, Any] = sentence_transformers_files(pooling, shape[0])
    if not normalize:
        files["modules.json"] = [m for m in files["modules.json"] if "Normalize" not in m["type"]]
        del files["2_Normalize/config.json"]
    files.update(
        {
            "tokenizer_config.json": tokenizer_config,
            "special_tokens_map.json": tokens,
            "sentence_bert_config.json": {
                "max_seq_length": max_seq_length or positions,
                "do_lower_case": False,
            },
        }
    )
    for name, content in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return out
