"""The model directory a benchmark gives every server, so that all of them read the same weights.

A demo name is its built directory. The default model (or any GGUF file) is loaded the way
`stepline serve` loads it (`--dtype auto`: float32 on the CPU backend, as stored on a GPU)
and saved once as a plain mlx-lm directory in stepline's cache, which mlx_lm.server and
vllm-mlx can load too: a peer given the 4-bit directory would run MLX's slow CPU quantized
matmul and lose for a reason that is not its scheduling.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def served_dir(model_name: str) -> Path:
    """A directory in mlx-lm layout holding `model_name` as stepline serves it."""
    from stepline.engine.cache_dirs import build_once, cache_root
    from stepline.engine.default_model import DEFAULT_MODEL
    from stepline.engine.gguf import is_gguf
    from stepline.engine.models import DEMO_MODELS, demo_model_path, load_model

    if model_name in DEMO_MODELS:
        return demo_model_path(model_name)
    if model_name != DEFAULT_MODEL and not is_gguf(model_name):
        return Path(model_name)
    loaded = load_model(model_name)
    dtype = loaded.weights.split(" ", 1)[0].replace("/", "-")
    target = cache_root(None) / "models" / f"{loaded.path.name}-served-{dtype}"
    import mlx.nn as nn
    from mlx_lm.utils import save_model

    def build(tmp: Path) -> None:
        save_model(tmp, loaded.model)
        config = json.loads((loaded.path / "config.json").read_text())
        if not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules()):
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(loaded.path / name, tmp / name)

    build_once(target, build)
    return target
