"""The images of a logged run's prompts, kept beside its event log so that its requests can
be re-executed: one file per image, named by the SHA-256 of its bytes (content-addressed: an
image sent a thousand times is kept once). Kept only when the log keeps prompts
(`log_prompts`): with prompts left out, the images are left out too. MLX-free.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def images_dir(log_path: str | Path) -> Path:
    """Where the images of the log at `log_path` are kept: `<log>.images/` beside it."""
    path = Path(log_path)
    return path.with_name(f"{path.name}.images")


def keep_image(directory: Path, digest: str, data: bytes) -> None:
    """Write `data` (whose SHA-256 is `digest`) as `directory/digest`, unless it is there:
    written whole to a temporary file and renamed, so a file that exists is complete."""
    final = directory / digest
    if final.exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{digest[:16]}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_image(directory: Path, digest: str) -> bytes | None:
    """The bytes kept as `digest`, or None when they are missing or are not what the digest
    says (a file changed since)."""
    try:
        data = (directory / digest).read_bytes()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == digest else None
