"""The prefix cache's file format (engine/prefix_files.py): an entry written by the
`safetensors` package reads back as it was, and as mlx-lm's own `load_prompt_cache` reads it;
a file written by the earlier hand-written writer (format 1) still loads; a flipped bit in
either is refused."""

from __future__ import annotations

import json
import struct
import zlib

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, load_prompt_cache

from stepline.engine import prefix_files
from stepline.engine.prefix_files import (
    _BadFile,
    load_entry_file,
    read_entry_info,
    serialize_entry,
    write_entry_file,
)

MODEL = "model-id"
TOKENS = tuple(range(3, 15))  # 12 tokens


def entry(dtype) -> list:
    """Three layers of the kinds a hybrid and a sliding-window model have, `dtype` data."""
    keys = mx.random.normal((1, 2, 12, 8), key=mx.random.key(0)).astype(dtype)
    values = mx.random.normal((1, 2, 12, 8), key=mx.random.key(1)).astype(dtype)
    kv = KVCache()
    kv.update_and_fetch(keys, values)
    rotating = RotatingKVCache(max_size=16, keep=0)
    rotating.update_and_fetch(keys, values)
    arrays = ArraysCache(2)
    arrays[0] = mx.ones((1, 3, 4), dtype=dtype)
    arrays[1] = mx.arange(6, dtype=mx.float32).reshape(1, 6)
    return [kv, rotating, arrays]


def write_format_1(payload) -> None:
    """The writer of format 1 (before the safetensors package wrote them), as it was: the
    header by hand, tensors widest first, the crc32 over the data as laid out."""
    tensors = sorted(
        payload.tensors, key=lambda t: -np.dtype(prefix_files._NP_DTYPE[t[1]]).itemsize
    )
    crc = 0
    for *_, buf in tensors:
        crc = zlib.crc32(buf, crc)
    header: dict = {}
    offset = 0
    for name, dtype, shape, buf in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + buf.nbytes],
        }
        offset += buf.nbytes
    metadata = {**payload.metadata, "0.format": "stepline-prefix-cache/1"}
    header["__metadata__"] = {**metadata, "0.data_crc32": f"{crc:08x}"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(payload.path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for *_, buf in tensors:
            f.write(buf)


def same_arrays(a: list, b: list) -> bool:
    """Whether two caches hold the same state: classes, arrays (dtype and values), scalars."""

    def leaves(cache: list) -> list:
        return tree_flatten([prefix_files._layer_state(layer) for layer in cache])

    def same(x, y) -> bool:
        if isinstance(x, mx.array):
            return isinstance(y, mx.array) and x.dtype == y.dtype and bool(mx.array_equal(x, y))
        return x == y

    return [type(x) for x in a] == [type(y) for y in b] and all(
        k == j and same(x, y) for (k, x), (j, y) in zip(leaves(a), leaves(b), strict=True)
    )


def flip_a_data_bit(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("writer", ["safetensors", "format 1"])
def test_an_entry_file_loads_back_as_it_was_written(tmp_path, dtype, writer):
    cache = entry(dtype)
    path = tmp_path / "entry.safetensors"
    payload = serialize_entry(TOKENS, cache, model_id=MODEL, trimmable=False, path=path)
    (write_entry_file if writer == "safetensors" else write_format_1)(payload)

    info = read_entry_info(path, MODEL)
    loaded = load_entry_file(path, TOKENS, MODEL)

    assert info.tokens == TOKENS and not info.trimmable
    assert same_arrays(loaded, cache)
    flip_a_data_bit(path)
    with pytest.raises(_BadFile, match="crc32"):
        load_entry_file(path, TOKENS, MODEL)


def test_mlx_lms_own_loader_reads_an_entry_file(tmp_path):
    cache = entry(mx.bfloat16)
    path = tmp_path / "entry.safetensors"
    write_entry_file(serialize_entry(TOKENS, cache, model_id=MODEL, trimmable=True, path=path))

    loaded, metadata = load_prompt_cache(str(path), return_metadata=True)

    assert same_arrays(loaded, cache)
    assert metadata["format"] == prefix_files.FORMAT and metadata["num_tokens"] == "12"
