"""The prefix cache's files: the safetensors format of one entry, and the writer thread.

Read and written here; which files exist and which to keep is `prefix_disk.DiskTier`'s
business. The writer thread gets numpy buffers and paths only, never MLX.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import struct
import threading
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from safetensors import TensorSpec, serialize_file

from stepline.engine.kv_quant import KVQuant, QuantizedKVCache, make_cache
from stepline.engine.throttle import Throttle

log = structlog.get_logger(__name__)

Cache = list[Any]


# -- the disk format ------------------------------------------------------------------
#
# One entry = one safetensors file in mlx-lm's `save_prompt_cache` layout, so
# `mlx_lm.models.cache.load_prompt_cache(path)` reads it as is: tensors named by
# `tree_flatten([layer.state for layer in cache])`, scalars stored as 0-d arrays and
# listed in the metadata, metadata = `tree_flatten([ours, class names, scalars])`.
# The `safetensors` package writes it from the numpy buffers (`serialize_file`, which
# takes bfloat16 as raw bytes, as `safetensors.numpy` cannot), so the writer thread needs
# no MLX. It is read here, header first (a scan reads no data) and with no MLX until the
# arrays are made. `ours` holds the format, the model fingerprint, the token ids with
# their sha256, trimmability and a crc32 of the data, all checked on read, so another
# model's file, a hash collision or a torn or bit-flipped file is never loaded.

# 2: written by the safetensors package, the crc32 over the tensors in name order (the
# package lays the data out itself). 1: written by hand, the crc32 over the data as laid
# out; still read.
FORMAT = "stepline-prefix-cache/2"
_FORMAT_1 = "stepline-prefix-cache/1"
_FINGERPRINT_SALT = _FORMAT_1  # a model's id stays that of the files already on disk
WRITER_THREAD_NAME = "stepline-prefix-writer"
_SUFFIX = ".safetensors"
_MAX_HEADER_BYTES = 256 * 2**20
_STALE_TMP_SECONDS = 600.0  # a temp file this old is a crashed write, not one in progress

# Every class whose `state` round-trips through `from_state` (mlx-lm's own loader rule);
# a quantized layer is stepline's `QuantizedKVCache`, mlx-lm's by name and state.
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
# The dtype names `safetensors.TensorSpec` takes.
_SPEC_DTYPE = {
    "BOOL": "bool",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}
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


def model_fingerprint(path: str | Path, kv: KVQuant | None = None) -> str:
    """Identity of a model directory's weights (and of how its KV is quantized: `kv`), for
    telling cache files apart.

    Hashes config.json and, for each weight file, its name, size and first and last MiB:
    cheap for any model size, and different for a fine-tune with the same shapes. Files of
    the same weights under other `--kv-bits` are another model's: left alone, never read.
    """
    path = Path(path)
    h = hashlib.sha256(_FINGERPRINT_SALT.encode())
    if kv is not None:  # (unquantized: the id of the files written before quantized KV)
        h.update(f"\0kv-bits={kv.bits}\0kv-group-size={kv.group_size}\0".encode())
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
    if cls is QuantizedKVCache and layer.keys is not None:
        n = layer.offset
        keys, values = (tuple(a[..., :n, :] for a in t) for t in (layer.keys, layer.values))
        return (keys, values, n, layer.group_size, layer.bits)
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


def _data_crc32(buffers: Sequence[np.ndarray]) -> str:
    crc = 0
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return f"{crc:08x}"


def write_entry_file(payload: _Payload) -> int:
    """Write one entry atomically (temp file + fsync + os.replace); returns its size.

    Runs on the writer thread: numpy buffers and file I/O only.
    """
    by_name = sorted(payload.tensors, key=lambda t: t[0])
    metadata = {**payload.metadata, "0.data_crc32": _data_crc32([t[3] for t in by_name])}
    specs = {
        # Pointers into `payload.tensors`' buffers, which live until this returns.
        name: TensorSpec(
            dtype=_SPEC_DTYPE[dtype],
            shape=list(shape),
            data_ptr=buf.ctypes.data,
            data_len=buf.nbytes,
        )
        for name, dtype, shape, buf in payload.tensors
    }
    path = payload.path
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        serialize_file(specs, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


@dataclass(frozen=True)
class _FileInfo:
    tokens: tuple[int, ...]
    trimmable: bool
    classes: list[str]
    scalars: list
    tensors: dict[str, dict]
    crc32: str
    crc_by_name: bool  # the crc32 is over the tensors in name order (else: as laid out)
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
    if not isinstance(ours, dict) or ours.get("format") not in (FORMAT, _FORMAT_1):
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
        crc_by_name=ours["format"] == FORMAT,
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
    if info.crc_by_name:
        slices = [(name, spec["data_offsets"]) for name, spec in info.tensors.items()]
        crc = _data_crc32([data[start:stop] for _, (start, stop) in sorted(slices)])
    else:
        crc = _data_crc32([data])
    if crc != info.crc32:
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
    for i, layer in enumerate(cache):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != len(tokens):
            raise _BadFile(f"a layer holds {offset} tokens, the entry says {len(tokens)}")
        check_arrays(i, layer, len(tokens))
    return cache


def check_arrays(i: int, layer: Any, num_tokens: int) -> None:
    """Raise _BadFile if layer `i`'s arrays cannot be what an entry of `num_tokens` tokens
    holds: a KV layer's arrays with fewer rows on their token axis than the tokens it claims
    (the window's, for a rotating one), or any array with a NaN or an infinity (every request
    served from it would end at its first token). Whole files (their crc32 right) can be
    wrong: written by a faulty build, or crafted."""
    kind = type(layer).__name__
    window = getattr(layer, "max_size", None)
    held = num_tokens if window is None else min(num_tokens, window)
    for name, leaf in tree_flatten(layer.state):
        if not isinstance(leaf, mx.array):
            continue
        if kind in _KV_CLASSES and leaf.ndim >= 2 and leaf.shape[-2] < held:
            raise _BadFile(
                f"layer {i} array {name!r} holds {leaf.shape[-2]} tokens, the entry {held}"
            )
        if mx.issubdtype(leaf.dtype, mx.floating) and not mx.isfinite(leaf).all().item():
            raise _BadFile(f"layer {i} array {name!r} holds a NaN or an infinity")


# -- the model's layout ---------------------------------------------------------------
#
# A file can be whole (its crc32 right) and still not fit the model: written by a build
# with other shapes, or crafted. Its arrays are checked against the layout of the model's
# own cache at load, or every request it served would fail in the forward pass.

# Layers whose arrays have a token axis (-2), which is the one dimension that may differ.
_KV_CLASSES = ("KVCache", "RotatingKVCache", "QuantizedKVCache")
# Per layer: its class, and per array of its state, (shape with None on the token axis, dtype).
Layout = tuple[tuple[str, dict[str, tuple[tuple[int | None, ...], str]]], ...]


def cache_layout(cache: Cache) -> Layout:
    """The class and the arrays' shapes (token axis left open) and dtypes of each layer."""
    layers = []
    for layer in cache:
        kind = type(layer).__name__
        arrays = {}
        for name, leaf in tree_flatten(layer.state):
            if isinstance(leaf, mx.array):
                shape: list[int | None] = list(leaf.shape)
                if kind in _KV_CLASSES and leaf.ndim >= 2:
                    shape[-2] = None
                arrays[name] = (tuple(shape), str(leaf.dtype))
        layers.append((kind, arrays))
    return tuple(layers)


def model_cache_layout(model: Any, kv: KVQuant | None = None) -> Layout:
    """`cache_layout` of the model's own cache (quantized as `kv` says) after one token
    (executor thread: MLX)."""
    cache = make_cache(model, kv)
    model(mx.array([[1]]), cache=cache)
    mx.eval([layer.state for layer in cache])
    return cache_layout(cache)


def check_layout(cache: Cache, expected: Layout) -> None:
    """Raise _BadFile naming the first layer and array of `cache` that does not fit
    `expected` (another class, an array the model has not, another shape or dtype)."""
    got = cache_layout(cache)
    if len(got) != len(expected):
        raise _BadFile(f"it has {len(got)} cache layers, the model {len(expected)}")
    for i, ((kind, arrays), (want_kind, want_arrays)) in enumerate(zip(got, expected, strict=True)):
        if kind != want_kind:
            raise _BadFile(f"layer {i} is a {kind}, the model's a {want_kind}")
        for name, (shape, dtype) in arrays.items():
            want = want_arrays.get(name)
            if want is None:
                raise _BadFile(f"layer {i} has an array {name!r} the model's cache has not")
            if (shape, dtype) != want:
                raise _BadFile(
                    f"layer {i} array {name!r} is {dtype} {_shape(shape)}, "
                    f"the model's is {want[1]} {_shape(want[0])}"
                )


def _shape(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"


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
        # A full disk fails every write: one warning a second for each kind of failure.
        self._failures = Throttle(interval_s=1.0)
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
                left_out = self._failures.admit((kind, type(exc).__name__))
                if left_out is not None:
                    log.warning(
                        "prefix_cache_disk_io_failed",
                        op=kind,
                        error=repr(exc),
                        left_out_since_last=left_out,
                    )


@atexit.register
def _close_all_writers() -> None:
    # Daemon threads are still alive when atexit runs: let queued writes land.
    for writer in list(_LIVE_WRITERS):
        writer.close(timeout=30.0)
