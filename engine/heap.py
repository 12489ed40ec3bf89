"""Giving the C heap's free memory back to the system.

glibc's malloc keeps most memory that was freed inside its heaps (one per thread that
allocates: the executor's MLX work, the tokenizers' worker threads) for later allocations;
after a burst, a server's RSS stays at its high-water mark. `malloc_trim` returns the free
pages. On the hybrid demo, after a warm-up of 300 requests, a server that never trimmed held
514 MB after 600 more, 88 MB of it free memory inside the heap; trimmed as the engine goes
idle, it held 428 MB (6 MB over its warm-up; `benchmarks/memory_growth.py`). Elsewhere (macOS,
musl) there is nothing to trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache
from typing import Any


@cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def trim() -> bool:
    """Return the C heap's free pages to the system; False where there is no glibc heap to
    trim. Takes the heap's lock: a few milliseconds with hundreds of MB free."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
