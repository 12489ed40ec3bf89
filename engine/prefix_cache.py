"""The prefix cache: prompt-cache snapshots keyed by the tokens they hold.

Entries come from checkpoint snapshots (taken during prefill at exactly their
offset) and from finished requests. A lookup returns the longest usable prefix
of a prompt, by these rules:

- An entry holding exactly the first k tokens of the prompt is usable at k, for
  every cache kind (its state is the state after exactly those k tokens).
- An entry that shares only its first m < k tokens with the prompt is usable at m
  only if every layer can be trimmed (`KVCache`, `RotatingKVCache` before it
  wraps). Recurrent layers (`ArraysCache`) cannot be cut back: such an entry is
  never used at any offset but its own, and the lookup falls back to the nearest
  earlier entry instead.
- At least one prompt token is always left to compute, since the first output
  token needs its logits.

Entries are shared, not copied, between the requests that hit them: a hit gets new
cache objects viewing the same MLX arrays, and MLX copies a buffer only when one
of them writes to it. Memory is bounded by a byte budget, least recently used out.

An optional disk tier (`DiskTier`) keeps every entry also as a safetensors file, so
entries outlive the process. Lookups try memory first and the disk index (same rules)
when it offers a longer prefix; a disk hit is loaded and put back into memory.
Everything here runs on the executor thread, except the disk writer thread, which
gets plain numpy buffers and does file I/O only.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    PromptTrie,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
)

log = structlog.get_logger(__name__)

Cache = list[Any]
_MODEL = "m"  # PromptTrie keys entries by model; one cache serves one model


def _alias_tree(x: Any) -> Any:
    if isinstance(x, mx.array):
        return x[...]  # a new array object viewing the same buffer: copy-on-write
    if isinstance(x, list):
        return [_alias_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_alias_tree(v) for v in x)
    return x


def share_cache(cache: Cache) -> Cache:
    """New cache objects over the same arrays; writes to either never reach the other."""
    out = []
    for layer in cache:
        copy = type(layer).__new__(type(layer))
        copy.__dict__.update(layer.__dict__)
        copy.state = _alias_tree(layer.state)
        out.append(copy)
    return out


def cache_nbytes(cache: Cache) -> int:
    return sum(layer.nbytes for layer in cache)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: Cache
    nbytes: int
    trimmable: bool


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # prompt tokens the cache already holds
    cache: Cache  # this request's own cache objects (sharing the entry's arrays)
    source: str  # "memory" or "disk"


@dataclass
class PrefixCacheStats:
    hits: int = 0  # from either tier
    misses: int = 0
    evictions: int = 0  # from memory
    inserts: int = 0
    nbytes: int = 0  # in memory
    entries: int = 0  # in memory
    cached_tokens: int = 0  # prompt tokens served from the cache, in total
    disk_hits: int = 0  # of `hits`, served by loading a file


# -- the disk format ------------------------------------------------------------------
#
# One entry = one safetensors file in mlx-lm's `save_prompt_cache` layout, so
# `mlx_lm.models.cache.load_prompt_cache(path)` reads it as is: tensors named by
# `tree_flatten([layer.state for layer in cache])`, scalars stored as 0-d arrays and
# listed in the metadata, metadata = `tree_flatten([ours, class names, scalars])`.
# The file is written by hand (8-byte header length, JSON header, raw data) so that
# the writer thread needs numpy buffers only, never MLX. `ours` holds the format, the
# model fingerprint, the token ids with their sha256, trimmability and a crc32 of the
# data, all checked on read, so another model's file, a hash collision or a torn or
# bit-flipped file is never loaded.

FORMAT = "stepline-prefix-cache/1"
WRITER_THREAD_NAME = "stepline-prefix-writer"
_SUFFIX = ".safetensors"
_MAX_HEADER_BYTES = 256 * 2**20
_STALE_TMP_SECONDS = 600.0  # a temp file this old is a crashed write, not one in progress

# Every class whose `state` round-trips through `from_state` (mlx-lm's own loader rule).
_CACHE_CLASSES: dict[str, type] = {
    c.__name__: c for c in (KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache)
}
_ST_DTYPE = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}
# numpy has no bfloat16: BF16 data travels as its uint16 bit pattern.
_NP_DTYPE = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": np.uint16,
    "F32": np.float32,
    "F64": np.float64,
}


class _Unserializable(Exception):
    """This entry holds something the file format cannot (it just stays memory-only)."""


class _NotOurs(Exception):
    """A file of another format or another model: left alone, never used."""


class _Unreadable(_NotOurs):
    """No prefix-cache header could be parsed: ours if its name says so (then: torn)."""


class _BadFile(Exception):
    """A file of ours that cannot be trusted (truncated, corrupt, mislabelled)."""


def tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def entry_file_name(model_id: str, tokens: Sequence[int]) -> str:
    """The file an entry is written to: derived from the model and a hash of the tokens."""
    return f"{model_id[:16]}-{tokens_sha256(tokens)[:40]}{_SUFFIX}"


def model_fingerprint(path: str | Path) -> str:
    """Identity of a model directory's weights, for telling cache files apart.

    Hashes config.json and, for each weight file, its name, size and first and last MiB:
    cheap for any model size, and different for a fine-tune with the same shapes.
    """
    path = Path(path)
    h = hashlib.sha256(FORMAT.encode())
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(f"\0{weights.name}\0{size}\0".encode())
        with open(weights, "rb") as f:
            h.update(f.read(2**20))
            f.seek(max(0, size - 2**20))
            h.update(f.read(2**20))
    return h.hexdigest()


@dataclass(frozen=True)
class _Payload:
    """One entry, ready for the writer thread: numpy buffers and strings only."""

    key: tuple[int, ...]
    path: Path
    tensors: tuple[tuple[str, str, tuple[int, ...], np.ndarray], ...]  # name, dtype, shape, bytes
    metadata: dict[str, str]  # the flat safetensors metadata, without the data crc32
    data_nbytes: int

    @property
    def nbytes_estimate(self) -> int:
        return self.data_nbytes + 200 * len(self.tensors) + sum(map(len, self.metadata.values()))


def _layer_state(layer: Any) -> Any:
    cls = type(layer)
    if _CACHE_CLASSES.get(cls.__name__) is not cls:
        raise _Unserializable(f"cache class {cls.__module__}.{cls.__name__}")
    if cls is KVCache and layer.keys is not None and layer.keys.shape[2] > layer.offset:
        n = layer.offset  # not the rest of its growth block
        return (layer.keys[..., :n, :], layer.values[..., :n, :], n)
    return layer.state


def _to_numpy(name: str, x: Any, scalars: list) -> tuple[str, np.ndarray]:
    """One flattened state leaf as (safetensors dtype, numpy array), like save_prompt_cache."""
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            return "BF16", np.array(x.view(mx.uint16))
        if x.dtype not in _ST_DTYPE:
            raise _Unserializable(f"array dtype {x.dtype}")
        return _ST_DTYPE[x.dtype], np.array(x)
    if isinstance(x, bool):
        scalars.append((name, "scalar"))
        return "BOOL", np.array(x, dtype=np.bool_)
    if isinstance(x, int):
        scalars.append((name, "scalar"))
        return "I32", np.array(x, dtype=np.int32)
    if isinstance(x, float):
        scalars.append((name, "scalar"))
        return "F32", np.array(x, dtype=np.float32)
    if isinstance(x, str):
        scalars.append((name, "string"))
        return "I32", np.array([ord(c) for c in x], dtype=np.int32)
    if x is None:
        scalars.append((name, "none"))
        return "F32", np.zeros((0,), dtype=np.float32)
    raise _Unserializable(f"state value of type {type(x).__name__}")


def serialize_entry(
    tokens: Sequence[int], cache: Cache, *, model_id: str, trimmable: bool, path: Path
) -> _Payload:
    """Copy an entry out of MLX into numpy buffers (executor thread: it reads MLX arrays).

    Raises _Unserializable for a cache the format cannot hold.
    """
    states = [_layer_state(layer) for layer in cache]
    scalars: list = [""]  # non-empty, or tree_flatten would drop it (as in mlx-lm)
    tensors = []
    for name, leaf in tree_flatten(states):
        dtype, arr = _to_numpy(name, leaf, scalars)
        tensors.append((name, dtype, tuple(arr.shape), arr.reshape(-1).view(np.uint8)))
    # Widest elements first: with an 8-aligned data start, every tensor is then aligned.
    tensors.sort(key=lambda t: -np.dtype(_NP_DTYPE[t[1]]).itemsize)
    ours = {
        "format": FORMAT,
        "model": model_id,
        "num_tokens": str(len(tokens)),
        "tokens_sha256": tokens_sha256(tokens),
        "tokens": ",".join(map(str, tokens)),
        "trimmable": "1" if trimmable else "0",
    }
    classes = [type(layer).__name__ for layer in cache]
    metadata = dict(tree_flatten([ours, classes, scalars]))
    return _Payload(
        key=tuple(tokens),
        path=path,
        tensors=tuple(tensors),
        metadata=metadata,
        data_nbytes=sum(t[3].nbytes for t in tensors),
    )


def _encode_header(payload: _Payload, crc: int) -> bytes:
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, buf in payload.tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + buf.nbytes],
        }
        offset += buf.nbytes
    header["__metadata__"] = {**payload.metadata, "0.data_crc32": f"{crc:08x}"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # pad so the data starts 8-aligned
    return struct.pack("<Q", len(raw)) + raw


def write_entry_file(payload: _Payload) -> int:
    """Write one entry atomically (temp file + fsync + os.replace); returns its size.

    Runs on the writer thread: numpy buffers and file I/O only.
    """
    crc = 0
    for _, _, _, buf in payload.tensors:
        crc = zlib.crc32(buf, crc)
    head = _encode_header(payload, crc)
    path = payload.path
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for _, _, _, buf in payload.tensors:
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(head) + payload.data_nbytes


@dataclass(frozen=True)
class _FileInfo:
    tokens: tuple[int, ...]
    trimmable: bool
    classes: list[str]
    scalars: list
    tensors: dict[str, dict]
    crc32: str
    data_start: int
    data_nbytes: int
    file_nbytes: int


def _read_info(f: Any, file_nbytes: int, model_id: str) -> _FileInfo:
    """Parse and check a file's header (no tensor data read).

    Raises _NotOurs for another format or model, _BadFile for a broken file of ours.
    """
    if file_nbytes < 8:
        raise _BadFile(f"{file_nbytes} bytes: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(_MAX_HEADER_BYTES, file_nbytes - 8):
        raise _BadFile(f"header length {n} does not fit the {file_nbytes}-byte file")
    try:
        header = json.loads(f.read(n))
        flat = header.pop("__metadata__")
        ours, classes, scalars = tree_unflatten(list(flat.items()))
    except Exception as exc:  # noqa: BLE001 - any parse failure means: not a usable file
        raise _Unreadable(f"unreadable header ({type(exc).__name__}: {exc})") from None
    if not isinstance(ours, dict) or ours.get("format") != FORMAT:
        raise _NotOurs(f"format {ours.get('format') if isinstance(ours, dict) else None!r}")
    if ours.get("model") != model_id:
        raise _NotOurs("written for another model")
    try:
        tokens = tuple(int(t) for t in ours["tokens"].split(",")) if ours["tokens"] else ()
        if len(tokens) != int(ours["num_tokens"]) or tokens_sha256(tokens) != ours["tokens_sha256"]:
            raise _BadFile("its token ids do not match their recorded count and sha256")
        end = 0
        for spec in sorted(header.values(), key=lambda s: s["data_offsets"][0]):
            start, stop = spec["data_offsets"]
            if start != end or stop < start or spec["dtype"] not in _NP_DTYPE:
                raise _BadFile("its tensor table is not contiguous or has an unknown dtype")
            end = stop
        crc = ours["data_crc32"]
        trimmable = ours["trimmable"] == "1"
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise _BadFile(f"malformed metadata ({type(exc).__name__}: {exc})") from None
    if 8 + n + end != file_nbytes:
        raise _BadFile(f"truncated or padded: {file_nbytes} bytes, the header says {8 + n + end}")
    return _FileInfo(
        tokens=tokens,
        trimmable=trimmable,
        classes=list(classes),
        scalars=list(scalars[1:]),
        tensors=header,
        crc32=crc,
        data_start=8 + n,
        data_nbytes=end,
        file_nbytes=file_nbytes,
    )


def read_entry_info(path: Path, model_id: str) -> _FileInfo:
    with open(path, "rb") as f:
        return _read_info(f, os.fstat(f.fileno()).st_size, model_id)


def load_entry_file(path: Path, tokens: tuple[int, ...], model_id: str) -> Cache:
    """Read, verify and rebuild one entry (executor thread: it creates MLX arrays).

    Raises _NotOurs/_BadFile/OSError if the file is not exactly the entry for `tokens`.
    """
    with open(path, "rb") as f:
        info = _read_info(f, os.fstat(f.fileno()).st_size, model_id)
        if info.tokens != tokens:
            raise _BadFile("it holds other tokens than its index entry (replaced or collided)")
        data = np.empty(info.data_nbytes, dtype=np.uint8)
        if f.readinto(data) != info.data_nbytes:
            raise _BadFile("truncated while reading")
    if f"{zlib.crc32(data):08x}" != info.crc32:
        raise _BadFile("its data does not match its crc32")
    leaves: dict[str, Any] = {}
    for name, spec in info.tensors.items():
        start, stop = spec["data_offsets"]
        arr = data[start:stop].view(_NP_DTYPE[spec["dtype"]]).reshape(spec["shape"])
        leaves[name] = arr
    for name, kind in info.scalars:
        if kind == "scalar":
            leaves[name] = leaves[name].item()
        elif kind == "string":
            leaves[name] = "".join(chr(c) for c in leaves[name].tolist())
        elif kind == "none":
            leaves[name] = None
        else:
            raise _BadFile(f"unknown scalar kind {kind!r}")
    for name, spec in info.tensors.items():
        if isinstance(leaves[name], np.ndarray):
            arr = mx.array(leaves[name])
            leaves[name] = arr.view(mx.bfloat16) if spec["dtype"] == "BF16" else arr
    states = tree_unflatten(list(leaves.items()))
    if len(states) != len(info.classes) or any(c not in _CACHE_CLASSES for c in info.classes):
        raise _BadFile(f"unexpected cache classes {info.classes}")
    cache = [_CACHE_CLASSES[c].from_state(s) for c, s in zip(info.classes, states, strict=True)]
    for layer in cache:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != len(tokens):
            raise _BadFile(f"a layer holds {offset} tokens, the entry says {len(tokens)}")
    return cache


# -- the writer thread ----------------------------------------------------------------

_LIVE_WRITERS: weakref.WeakSet[_Writer] = weakref.WeakSet()


class _Writer:
    """A thread that writes, deletes and touches cache files, in the order asked.

    It gets numpy buffers and paths only, and reports each write's outcome on `done`
    as (key, file size or None); the executor thread applies them to its index.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.done: queue.SimpleQueue[tuple[tuple[int, ...], int | None]] = queue.SimpleQueue()
        self._ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=WRITER_THREAD_NAME, daemon=True)
        self._thread.start()
        _LIVE_WRITERS.add(self)

    def submit(self, op: tuple) -> None:
        self._ops.put(op)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is done; False on timeout."""
        done = threading.Event()
        with self._lock:
            closing = self._closing
            if not closing:
                self._ops.put(done)
        if closing:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return done.wait(timeout)

    def stop(self) -> None:
        """Finish what is queued, then end the thread (does not wait)."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._ops.put(None)

    def close(self, timeout: float | None = None) -> None:
        self.stop()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            if isinstance(op, threading.Event):
                op.set()
                continue
            kind, arg = op
            try:
                if kind == "write":
                    try:
                        self.done.put((arg.key, write_entry_file(arg)))
                    except Exception:
                        self.done.put((arg.key, None))
                        raise
                elif kind == "delete":
                    arg.unlink(missing_ok=True)
                elif kind == "touch":
                    os.utime(arg)
            except Exception as exc:  # noqa: BLE001 - a failed write costs a cache entry, no more
                log.warning("prefix_cache_disk_io_failed", op=kind, error=repr(exc))


@atexit.register
def _close_all_writers() -> None:
    # Daemon threads are still alive when atexit runs: let queued writes land.
    for writer in list(_LIVE_WRITERS):
        writer.close(timeout=30.0)


# -- the disk index -------------------------------------------------------------------


@dataclass
class _DiskEntry:
    tokens: tuple[int, ...]
    path: Path
    nbytes: int
    trimmable: bool


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    entry: _DiskEntry | None = None
    num_trimmable: int = 0  # trimmable entries at this node or below


class _DiskIndex:
    """A token trie of the files on disk that answers lookups without reading any file."""

    def __init__(self) -> None:
        self.root = _Node()

    def _path(self, tokens: Sequence[int]) -> list[_Node] | None:
        nodes = [self.root]
        for tok in tokens:
            nxt = nodes[-1].children.get(tok)
            if nxt is None:
                return None
            nodes.append(nxt)
        return nodes

    def add(self, entry: _DiskEntry) -> None:
        nodes = [self.root]
        for tok in entry.tokens:
            nodes.append(nodes[-1].children.setdefault(tok, _Node()))
        assert nodes[-1].entry is None, "remove the old entry first"
        nodes[-1].entry = entry
        if entry.trimmable:
            for node in nodes:
                node.num_trimmable += 1

    def remove(self, tokens: tuple[int, ...]) -> None:
        nodes = self._path(tokens)
        if nodes is None or nodes[-1].entry is None:
            return
        if nodes[-1].entry.trimmable:
            for node in nodes:
                node.num_trimmable -= 1
        nodes[-1].entry = None
        for depth in range(len(tokens), 0, -1):  # prune the branch that is now empty
            node = nodes[depth]
            if node.children or node.entry is not None:
                break
            del nodes[depth - 1].children[tokens[depth - 1]]

    def has_trimmable_extension(self, tokens: Sequence[int]) -> bool:
        """Whether a trimmable entry holds `tokens` and more (so it can serve `tokens`)."""
        nodes = self._path(tokens)
        if nodes is None:
            return False
        node = nodes[-1]
        own = 1 if node.entry is not None and node.entry.trimmable else 0
        return node.num_trimmable - own > 0

    def trimmable_prefixes(self, tokens: Sequence[int]) -> list[_DiskEntry]:
        nodes = self._path(tokens) or []
        return [n.entry for n in nodes[:-1] if n.entry is not None and n.entry.trimmable]

    def best(self, wanted: Sequence[int]) -> tuple[int, _DiskEntry] | None:
        """The longest usable prefix of `wanted`: an exact entry, or a trimmable one cut back."""
        nodes = [self.root]
        exact: tuple[int, _DiskEntry] | None = None
        for tok in wanted:
            nxt = nodes[-1].children.get(tok)
            if nxt is None:
                break
            nodes.append(nxt)
            if nxt.entry is not None:
                exact = (len(nodes) - 1, nxt.entry)
        floor = exact[0] if exact else 0
        for depth in range(len(nodes) - 1, floor, -1):
            if nodes[depth].num_trimmable:
                node = nodes[depth]
                while node.entry is None or not node.entry.trimmable:
                    node = next(c for c in node.children.values() if c.num_trimmable)
                return depth, node.entry
        return exact


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
    headers only; entries are read back lazily, on a hit. Files of other models in the
    same directory are left alone.
    """

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        model_id: str,
        *,
        max_pending_bytes: int = 2**30,
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
        self.stats = DiskStats()
        self._index = _DiskIndex()
        self._lru: OrderedDict[tuple[int, ...], _DiskEntry] = OrderedDict()  # oldest use first
        self._pending: dict[tuple[int, ...], tuple[int, bool, Path]] = {}  # being written
        self._pending_bytes = 0
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
            self._add(_DiskEntry(info.tokens, path, info.file_nbytes, info.trimmable))
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

    def _remove(self, key: tuple[int, ...], *, delete: bool) -> None:
        entry = self._lru.pop(key, None)
        if entry is None:
            return
        self._index.remove(key)
        self.stats.nbytes -= entry.nbytes
        self.stats.entries = len(self._lru)
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
            self._add(_DiskEntry(key, path, nbytes, trimmable))
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

    def best(self, prompt: Sequence[int]) -> tuple[int, _DiskEntry] | None:
        """The longest usable prefix of `prompt` on disk (at most len(prompt) - 1 tokens)."""
        self._drain()
        if len(prompt) < 2 or not self._lru:
            return None
        return self._index.best(prompt[: len(prompt) - 1])

    def load(self, entry: _DiskEntry) -> Cache | None:
        """The entry's cache, or None if its file is unusable (then it is dropped)."""
        try:
            cache = load_entry_file(entry.path, entry.tokens, self.model_id)
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


class PrefixCache:
    """Memory tier (bytes budget, LRU) plus an optional disk tier.

    `disk_dir` turns the disk tier on: up to `disk_max_bytes` of files, tagged with
    `model_id` (see `model_fingerprint`) so they are only ever used for the same model.
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        disk_dir: str | Path | None = None,
        disk_max_bytes: int = 0,
        model_id: str = "",
    ):
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._trie = PromptTrie()
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest use first
        self.stats = PrefixCacheStats()
        self.disk = DiskTier(disk_dir, disk_max_bytes, model_id) if disk_dir is not None else None

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, tokens: Sequence[int], cache: Cache, *, persist: bool = True) -> None:
        """Keep `cache`, whose state is exactly that after `tokens`. The caller gives it up.

        With a disk tier and `persist`, the entry is also written to disk (in the background).
        """
        key = tuple(tokens)
        if not key:
            return
        entry = _Entry(key, cache, cache_nbytes(cache), can_trim_prompt_cache(cache))
        if persist and self.disk is not None:
            self.disk.offer(key, cache, entry.trimmable)
        if entry.nbytes > self.max_bytes:
            return
        old = self._lru.pop(key, None)
        if old is not None:
            self.stats.nbytes -= old.nbytes
        self._trie.add(_MODEL, list(key), entry)
        self._lru[key] = entry
        self.stats.nbytes += entry.nbytes
        self.stats.inserts += 1
        if entry.trimmable:
            # Trimmable prefixes of this entry are redundant: it can serve them all.
            for n, prefix in self._trie.pop_prefixes(_MODEL, list(key)):
                if prefix.trimmable and n < len(key):
                    self._drop(key[:n], count=False)
                else:
                    self._trie.add(_MODEL, list(key[:n]), prefix)  # keep: put it back
        self._evict()
        self.stats.entries = len(self._lru)

    def _drop(self, key: tuple[int, ...], *, count: bool) -> None:
        entry = self._lru.pop(key, None)
        if entry is None:
            return
        try:
            self._trie.pop(_MODEL, list(key))
        except KeyError:
            pass  # already taken out of the trie by pop_prefixes
        self.stats.nbytes -= entry.nbytes
        if count:
            self.stats.evictions += 1

    def _evict(self) -> None:
        while self.stats.nbytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru)), count=True)
        self.stats.entries = len(self._lru)

    def _memory_best(self, prompt: Sequence[int]) -> tuple[int, _Entry] | None:
        best: tuple[int, _Entry] | None = None
        if len(prompt) >= 2 and self._lru:
            wanted = list(prompt[: len(prompt) - 1])
            found = self._trie.search(_MODEL, wanted)
            if found.exact is not None:
                best = (len(wanted), self._trie.get(_MODEL, found.exact))
            else:
                if found.shorter is not None:
                    best = (len(found.shorter), self._trie.get(_MODEL, found.shorter))
                if found.longer is not None and found.common_prefix > (best[0] if best else 0):
                    entry = self._trie.get(_MODEL, found.longer)
                    if entry.trimmable:
                        best = (found.common_prefix, entry)
        return best

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest usable cached prefix of `prompt` (at most len(prompt) - 1 tokens).

        Memory first; the disk tier when it holds a longer usable prefix. A file that
        turns out unusable is skipped (logged, dropped) and the next best is tried.
        """
        best = self._memory_best(prompt)
        in_memory = best[0] if best else 0
        while self.disk is not None and (found := self.disk.best(prompt)) and found[0] > in_memory:
            n, disk_entry = found
            cache = self.disk.load(disk_entry)
            if cache is None:
                continue  # that file was bad and is gone from the index: try the next best
            self.insert(disk_entry.tokens, cache, persist=False)
            self.stats.disk_hits += 1
            return self._serve(n, disk_entry.tokens, cache, "disk")
        if best is None:
            self.stats.misses += 1
            return None
        n, entry = best
        self._lru.move_to_end(entry.tokens)
        if self.disk is not None:
            self.disk.touch(entry.tokens)
        return self._serve(n, entry.tokens, entry.cache, "memory")

    def _serve(self, n: int, tokens: tuple[int, ...], cache: Cache, source: str) -> PrefixHit:
        mine = share_cache(cache)
        if n < len(tokens):
            for layer in mine:
                layer.trim(len(tokens) - n)
        self.stats.hits += 1
        self.stats.cached_tokens += n
        return PrefixHit(num_tokens=n, cache=mine, source=source)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the disk tier's queued writes are on disk (True at once without one).

        Call it on the thread that owns the cache: the finished writes then show in the
        index and `disk.stats`. False on timeout.
        """
        return True if self.disk is None else self.disk.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Let the queued disk writes finish and stop the writer thread."""
        if self.disk is not None:
            self.disk.close(timeout)
