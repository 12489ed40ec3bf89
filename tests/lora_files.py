"""LoRA and DoRA adapters built offline for the tests, in `mlx_lm.lora`'s format (random
`lora_a`, nonzero `lora_b`: they change the model's output), for any loaded mlx-lm model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def make_adapter(
    path: Path,
    model: Any,
    *,
    seed: int,
    kind: str = "lora",
    rank: int = 4,
    scale: float = 2.0,
    keys: Sequence[str] = KEYS,
    num_layers: int | None = None,
    std: float = 0.1,
    config: dict | None = None,
) -> Path:
    """An adapter of `kind` ("lora", "dora") for `model`'s last `num_layers` blocks (all:
    None), on the Linears `keys`, saved in `path` as mlx_lm.lora saves one."""
    import mlx.core as mx
    import mlx.nn as nn

    mx.random.seed(seed)
    layers = model.layers
    num_layers = len(layers) if num_layers is None else num_layers
    first = len(layers) - num_layers
    weights = {}
    for i in range(first, len(layers)):
        for key in keys:
            linear = layers[i]
            for part in key.split("."):
                linear = getattr(linear, part)
            if isinstance(linear, nn.QuantizedLinear):
                d_out, d_in = linear.weight.shape[0], linear.weight.shape[1] * 32 // linear.bits
            else:
                d_out, d_in = linear.weight.shape
            name = f"model.layers.{i}.{key}"
            weights[f"{name}.lora_a"] = mx.random.normal((d_in, rank)) * std
            weights[f"{name}.lora_b"] = mx.random.normal((rank, d_out)) * std
            if kind == "dora":
                weights[f"{name}.m"] = mx.linalg.norm(linear.weight, axis=1) * mx.random.uniform(
                    0.8, 1.2, (d_out,)
                )
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(
        json.dumps(
            config
            or {
                "fine_tune_type": kind,
                "num_layers": num_layers,
                "lora_parameters": {
                    "rank": rank,
                    "scale": scale,
                    "dropout": 0.0,
                    "keys": list(keys),
                },
            }
        )
    )
    return path


def mlx_lm_with_adapter(model_path: Path, adapter: Path | None) -> Any:
    """mlx-lm's own model with the adapter (`load(base, adapter_path=...)`), in the dtype
    stepline gives the base model (`fit_dtype`)."""
    from mlx_lm.utils import load

    from stepline.engine.models import fit_dtype

    model, _ = load(str(model_path), adapter_path=None if adapter is None else str(adapter))
    fit_dtype(model)
    return model
