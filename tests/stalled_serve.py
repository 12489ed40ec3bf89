"""`stepline serve` with one of its MLX calls stalled (tests/test_serve_stop.py):

    python tests/stalled_serve.py load|warmup SERVE_ARGS...

The model's load, or the warm-up's first turn, never returns: as a call on the executor
thread that cannot be interrupted stalls it (SmolLM2's warm-up step on a busy CPU took a
minute). The process prints `stalled: load` (or `warmup`) when the call starts.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import stepline.engine  # noqa: F401 - OpenBLAS before MLX, as the `stepline` command does


def _stall(what: str) -> Any:
    print(f"stalled: {what}", flush=True)
    threading.Event().wait()


def main() -> int:
    what, argv = sys.argv[1], sys.argv[2:]
    if what == "load":
        from stepline.engine import models

        models.load_model = lambda *args, **kwargs: _stall("load")
    elif what == "warmup":
        from stepline.actors.scheduler.warmup import Warmup

        Warmup.run = lambda self, stop=None: _stall("warmup")  # type: ignore[method-assign]
    else:
        raise SystemExit(f"stall what? {what!r} (load or warmup)")
    from stepline.api.cli import main as stepline

    return stepline(argv)


if __name__ == "__main__":
    sys.exit(main())
