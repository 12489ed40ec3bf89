"""The vision demos, built on first use like the text demos, with the demo tokenizer, for
tests and for trying images offline: `stepline-demo-vision` (a random-weight Idefics3,
`idefics3.DEMO`) and `stepline-demo-vision-qwen` (a random-weight Qwen2.5-VL,
`qwen_vl.DEMO`); and what every mlx-vlm demo's builder (the audio and omni ones too) and the
tests' checkpoints share: seeded random weights (`random_weights`), the end tokens and the
saved checkpoint with its special tokens' head rows zeroed (`save_demo`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from stepline.engine import demo_files
from stepline.engine.demo_files import VISION_DEMO, VISION_QWEN_DEMO

_DEMO_BUILD_VERSION = 1
# the demo tokenizer's end tokens (`<|im_end|>`, `<|endoftext|>`), every demo's eos_token_id
DEMO_EOS = [
    demo_files.SPECIAL_TOKENS.index(demo_files.IM_END),
    demo_files.SPECIAL_TOKENS.index(demo_files.ENDOFTEXT),
]


def demo_path(cache_dir: str | Path | None = None, name: str = VISION_DEMO) -> Path:
    """The directory of the vision demo `name` (`stepline-demo-vision`, an Idefics3, or
    `stepline-demo-vision-qwen`, a Qwen2.5-VL), built there on first use."""
    from stepline.engine.vision import idefics3, qwen_vl

    if name == VISION_QWEN_DEMO:
        shape, build = qwen_vl.DEMO, qwen_vl.build_qwen2_5_vl
    else:
        shape, build = idefics3.DEMO, idefics3.build_idefics3
    return demo_files.multimodal_demo_path(
        name, _DEMO_BUILD_VERSION, shape, lambda out: build(out, shape), cache_dir
    )


def random_weights(
    config: Mapping[str, Any],
    seed: int,
    init_std: float,
    norm: Callable[[str], float] | None = None,
) -> dict[str, mx.array]:
    """Seeded random float32 weights of the mlx-vlm model that `config` (a config.json)
    describes, by parameter name: biases 0, norms `norm(name)` (default 1), the rest normal
    of `init_std`, each from its own key (independent of MLX's global RNG)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    raw = json.loads(json.dumps(config))
    module, _ = get_model_and_args(raw)
    model = module.Model(
        update_module_configs(module.ModelConfig.from_dict(raw), module, raw, ["text", "vision"])
    )
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = {}
    for i, name in enumerate(names):
        dims = params[name].shape
        if name.endswith("bias"):
            value = mx.zeros(dims)
        elif "norm" in name and len(dims) == 1:
            value = mx.full(dims, norm(name) if norm is not None else 1.0)
        else:
            value = init_std * mx.random.normal(dims, key=keys[i])
        weights[name] = value.astype(mx.float32)
    return weights


def save_demo(
    out: Path, config: Mapping[str, Any], shape: Mapping[str, Any], head: str, media_ids: mx.array
) -> None:
    """The random-weight checkpoint of `config` (a config.json) at `out`: its weights
    (`random_weights` of `shape`'s seed and init_std) with the rows of `head` (its lm head's
    weight) at the demo tokenizer's special and markup tokens and at `media_ids` zeroed (as in
    the text demos: a random model must not rank the special tokens first), and its config."""
    weights = random_weights(config, shape["seed"], shape["init_std"])
    markup = len(demo_files.SPECIAL_TOKENS) + len(demo_files.MARKUP_TOKENS)
    reserved = mx.concatenate([mx.arange(markup), media_ids])
    weights[head] = weights[head].at[reserved].multiply(0.0)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
