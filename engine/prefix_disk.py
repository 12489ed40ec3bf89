"""The prefix cache's disk tier: entries as safetensors files that outlive the process.

Owned by the executor thread (`PrefixStore` calls it there); the writer thread of
`prefix_files` does the file I/O. The tier keeps its own budget (the files are its own)
and reports which entries it gained or lost, so the step loop's `PrefixIndex` mirrors
them: lookups happen there, with the same rule for both tiers.
"""

from __future__ import annotations

import queue
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import structlog

from stepline.actors.scheduler.prefix_index import EntryInfo, Tokens, TokenTrie
from stepline.engine.prefix_files import (
    _LIVE_WRITERS,
    _STALE_TMP_SECONDS,
    _SUFFIX,
    Layout,
    _BadFile,
    _FileInfo,
    _NotOurs,
    _Unreadable,
    _Unserializable,
    _Writer,
    check_layout,
    entry_file_name,
    load_entry_file,
    read_entry_info,
    serialize_entry,
)

log = structlog.get_logger(__name__)

Cache = list[Any]


# -- the disk tier -------------------------------------------------------------------


@dataclass
class _DiskEntry:
    tokens: tuple[int, ...]
    trimmable: bool
    path: Path
    nbytes: int


@dataclass
class DiskStats:
    entries: int = 0
    nbytes: int = 0  # file bytes of this model's entries
    hits: int = 0
    evictions: int = 0  # files removed to stay under the cap
    writes: int = 0
    write_errors: int = 0
    dropped: int = 0  # entries not written because the writer was too far behind
    skipped: int = 0  # corrupt, truncated or mislabelled files found and removed


class DiskTier:
    """Prefix-cache entries as files in `directory`, at most `max_bytes` of them.

    Owned by the executor thread (call every method there); its writer thread does the
    file I/O. At start the index is rebuilt from the files'
    headers only; entries are read back lazily, on a hit, and checked against the model's
    cache `layout` (classes, shapes, dtypes) when given. Files of other models in the
    same directory are left alone.
    """

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        model_id: str,
        *,
        max_pending_bytes: int = 2**30,
        layout: Layout | None = None,
    ):
        if max_bytes < 0:
            raise ValueError(f"prefix cache disk max_bytes must be >= 0, got {max_bytes}")
        self.directory = Path(directory).expanduser().resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"prefix cache dir {self.directory} cannot be created ({exc}); "
                "pass a writable directory"
            ) from exc
        self.max_bytes = max_bytes
        self.model_id = model_id
        self.max_pending_bytes = max_pending_bytes
        self.layout = layout  # the model's cache layout: a file that does not fit is dropped
        self.stats = DiskStats()
        self._index = TokenTrie()
        self._lru: OrderedDict[tuple[int, ...], _DiskEntry] = OrderedDict()  # oldest use first
        self._pending: dict[tuple[int, ...], tuple[int, bool, Path]] = {}  # being written
        self._pending_bytes = 0
        # Changes not yet reported to the step loop's index (see `take_changes`).
        self._added: list[EntryInfo] = []
        self._removed: list[Tokens] = []
        # A writer of this process (an engine before a restart) may still be writing here.
        for other in list(_LIVE_WRITERS):
            if other.directory == self.directory:
                other.flush(timeout=60.0)
        self._writer = _Writer(self.directory)
        weakref.finalize(self, self._writer.stop)
        self._scan()

    # -- start-up -------------------------------------------------------------

    def _scan(self) -> None:
        prefix = self.model_id[:16]
        found: list[tuple[float, _FileInfo, Path]] = []
        now = time.time()
        for path in self.directory.iterdir():
            name = path.name
            try:
                if name.startswith(f".{prefix}-") and name.endswith(".tmp"):
                    if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                        self._writer.submit(("delete", path))
                    continue
                if not name.endswith(_SUFFIX) or not path.is_file():
                    continue
                found.append((path.stat().st_mtime, read_entry_info(path, self.model_id), path))
            except _Unreadable as exc:
                if name.startswith(f"{prefix}-"):  # ours by its name, torn in its header
                    self._skip(path, str(exc))
            except _NotOurs:
                continue
            except (_BadFile, OSError) as exc:
                self._skip(path, str(exc))
        for _, info, path in sorted(found, key=lambda f: f[0]):  # oldest access first
            self._add(_DiskEntry(info.tokens, info.trimmable, path, info.file_nbytes))
        for entry in list(self._lru.values()):
            if entry.trimmable and self._index.has_trimmable_extension(entry.tokens):
                self._remove(entry.tokens, delete=True)  # a longer trimmable entry serves it
        self._evict()
        log.info(
            "prefix_cache_disk_opened",
            dir=str(self.directory),
            entries=self.stats.entries,
            nbytes=self.stats.nbytes,
        )

    def _skip(self, path: Path, reason: str) -> None:
        log.warning("prefix_cache_file_skipped", path=str(path), reason=reason)
        self.stats.skipped += 1
        self._writer.submit(("delete", path))

    # -- the index ------------------------------------------------------------

    def _add(self, entry: _DiskEntry) -> None:
        old = self._lru.get(entry.tokens)
        if old is not None:
            self._remove(old.tokens, delete=old.path != entry.path)
        self._index.add(entry)
        self._lru[entry.tokens] = entry
        self.stats.nbytes += entry.nbytes
        self.stats.entries = len(self._lru)
        self._added.append(EntryInfo(entry.tokens, entry.nbytes, entry.trimmable))

    def _remove(self, key: tuple[int, ...], *, delete: bool) -> None:
        entry = self._lru.pop(key, None)
        if entry is None:
            return
        self._index.remove(key)
        self.stats.nbytes -= entry.nbytes
        self.stats.entries = len(self._lru)
        self._removed.append(key)
        if delete:
            self._writer.submit(("delete", entry.path))

    def _evict(self) -> None:
        while self.stats.nbytes + self._pending_bytes > self.max_bytes and self._lru:
            self._remove(next(iter(self._lru)), delete=True)
            self.stats.evictions += 1

    def _drain(self) -> None:
        """Apply the writer's finished writes to the index."""
        while True:
            try:
                key, nbytes = self._writer.done.get_nowait()
            except queue.Empty:
                break
            estimate, trimmable, path = self._pending.pop(key)
            self._pending_bytes -= estimate
            if nbytes is None:
                self.stats.write_errors += 1
                continue
            self.stats.writes += 1
            self._add(_DiskEntry(key, trimmable, path, nbytes))
            if trimmable:  # only now that the longer entry is safely on disk
                for shorter in self._index.trimmable_prefixes(key):
                    self._remove(shorter.tokens, delete=True)
        self._evict()

    # -- what the prefix cache calls ------------------------------------------

    def offer(self, tokens: tuple[int, ...], cache: Cache, trimmable: bool) -> None:
        """Have `cache` (the state after exactly `tokens`) written, unless it is redundant."""
        self._drain()
        if not tokens or tokens in self._lru or tokens in self._pending or self.max_bytes == 0:
            return
        if trimmable and self._index.has_trimmable_extension(tokens):
            return
        path = self.directory / entry_file_name(self.model_id, tokens)
        try:
            payload = serialize_entry(
                tokens, cache, model_id=self.model_id, trimmable=trimmable, path=path
            )
        except _Unserializable as exc:
            log.debug("prefix_cache_entry_not_persisted", reason=str(exc))
            return
        size = payload.nbytes_estimate
        if size > self.max_bytes:
            return
        if self._pending_bytes + size > self.max_pending_bytes:
            self.stats.dropped += 1  # memory for buffers is bounded; the entry stays in memory
            return
        self._pending[tokens] = (size, trimmable, path)
        self._pending_bytes += size
        self._writer.submit(("write", payload))
        self._evict()

    def take_changes(self) -> tuple[list[EntryInfo], list[Tokens]]:
        """Entries gained and lost since the last call (for the step loop's index)."""
        self._drain()
        added, removed = self._added, self._removed
        self._added, self._removed = [], []
        return added, removed

    def get(self, tokens: Tokens) -> _DiskEntry | None:
        return self._lru.get(tokens)

    def entries(self) -> list[_DiskEntry]:
        self._drain()
        return list(self._lru.values())

    def load(self, entry: _DiskEntry) -> Cache | None:
        """The entry's cache, or None if its file is unusable (then it is dropped)."""
        try:
            cache = load_entry_file(entry.path, entry.tokens, self.model_id)
            if self.layout is not None:
                check_layout(cache, self.layout)
            mx.eval([layer.state for layer in cache])
        except _Unreadable as exc:  # indexed as ours, now torn
            self._remove(entry.tokens, delete=False)
            self._skip(entry.path, str(exc))
            return None
        except (FileNotFoundError, _NotOurs) as exc:
            # Gone, or replaced by a file that is not this model's: not ours to delete.
            log.warning("prefix_cache_file_skipped", path=str(entry.path), reason=str(exc))
            self.stats.skipped += 1
            self._remove(entry.tokens, delete=False)
            return None
        # Whatever a damaged file makes the parser or MLX raise, the answer is the same.
        except Exception as exc:  # noqa: BLE001
            self._remove(entry.tokens, delete=False)
            self._skip(entry.path, str(exc) if isinstance(exc, _BadFile) else repr(exc))
            return None
        self.stats.hits += 1
        self.touch(entry.tokens)
        return cache

    def touch(self, tokens: tuple[int, ...]) -> None:
        """Mark an entry used (its file's mtime keeps the order across restarts)."""
        entry = self._lru.get(tokens)
        if entry is not None:
            self._lru.move_to_end(tokens)
            self._writer.submit(("touch", entry.path))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the writes queued so far and apply them to the index (owning thread
        only). False on timeout."""
        ok = self._writer.flush(timeout)
        self._drain()
        return ok

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued writes and stop the writer thread."""
        self._writer.close(timeout)
        self._drain()
