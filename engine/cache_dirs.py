"""stepline's cache on disk: where it is, and directories built in it once, atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# In a directory converted from a GGUF file (engine/gguf.py): what that file was (its path,
# size and type), for model listings; read without MLX.
GGUF_SOURCE_FILE = "gguf_source.json"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """stepline's cache: `cache_dir`, else $STEPLINE_CACHE_DIR, else stepline/ in
    $XDG_CACHE_HOME or ~/.cache. Everything stepline keeps (models, warm-up samples, the
    OpenBLAS copy) lives below it."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("STEPLINE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stepline"


def build_once(final: Path, build: Callable[[Path], None]) -> bool:
    """Make directory `final` with `build(tmp)` unless it exists; True if built now.

    Built in a temporary directory next to it and renamed into place, so a directory that
    exists is complete, and concurrent first uses are safe (one build wins, the others are
    discarded). Raises what `build` raises; nothing is left behind then.
    """
    if final.is_dir():
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-building-", dir=final.parent))
    try:
        build(tmp)
        os.replace(tmp, final)
    except OSError:
        # Another process renamed its build into place first (ENOTEMPTY/EEXIST): use that.
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True
