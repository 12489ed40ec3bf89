"""What Ollama's model listings (`/api/tags`, `/api/ps`, `/api/show`) say of a served model,
read once from its files: the weights' size and parameter count (from the safetensors
headers alone), the family, and what the file was: a GGUF file's type (Q4_1, Q4_K_M), else
mlx-lm's quantization or the dtype stored. No MLX.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from stepline.engine.cache_dirs import GGUF_SOURCE_FILE


@dataclass(frozen=True)
class ModelFacts:
    """What Ollama's model listings say of the served model, read once from its files."""

    size: int  # bytes of weights (a GGUF model's: its file's)
    num_params: int
    # a GGUF file's type (Q4_1, Q4_K_M, F16), else Q4, Q8 (mlx-lm's quantization), else the
    # weights' dtype as stored (F32, BF16)
    quantization_level: str
    family: str  # config.json's model_type
    digest: str
    modified_at: str
    format: str = "safetensors"  # "gguf": converted from a GGUF file

    @classmethod
    def read(cls, path: Path) -> ModelFacts:
        facts = cls._read_dir(path)
        source = path / GGUF_SOURCE_FILE  # a converted GGUF file's (engine/gguf.py)
        if not source.is_file():
            return facts
        gguf = json.loads(source.read_text())
        return replace(
            facts,
            format="gguf",
            size=int(gguf.get("size") or facts.size),
            quantization_level=gguf.get("file_type") or facts.quantization_level,
        )

    @classmethod
    def _read_dir(cls, path: Path) -> ModelFacts:
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        quant = config.get("quantization") or {}
        size = num_params = 0
        dtypes: dict[str, int] = {}
        for f in sorted(path.glob("*.safetensors")):
            size += f.stat().st_size
            for name, dtype, n in _tensors(f):
                module, _, kind = name.rpartition(".")
                if kind in ("scales", "biases") and quant:
                    continue  # a quantized weight's companions: no parameters of their own
                if dtype == "U32" and quant:  # packed: 32 bits hold 32 / bits parameters
                    bits = (quant.get(module) or {}).get("bits", quant.get("bits", 32))
                    n = n * 32 // bits
                num_params += n
                dtypes[dtype] = dtypes.get(dtype, 0) + n
        stamp = config_file.stat().st_mtime if config_file.is_file() else time.time()
        digest = hashlib.sha256(f"{path.resolve()}:{size}:{stamp}".encode()).hexdigest()
        level = (
            f"Q{quant['bits']}"
            if "bits" in quant
            else max(dtypes, key=dtypes.__getitem__, default="")
        )
        return cls(
            size=size,
            num_params=num_params,
            quantization_level=level,
            family=str(config.get("model_type", "")),
            digest=digest,
            modified_at=datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z"),
        )

    @property
    def parameter_size(self) -> str:
        n = self.num_params
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e6:.1f}M"


def _tensors(file: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, elements) of each tensor in a safetensors file, from its header alone."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    out = []
    for name, info in header.items():
        if name != "__metadata__":
            n = 1
            for d in info["shape"]:
                n *= d
            out.append((name, info["dtype"], n))
    return out
