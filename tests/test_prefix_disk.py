"""The prefix cache's disk tier: entries outlive the engine, and a bad file is never used."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import wait_until
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, make_prompt_cache
from prefix_parts import Prefixes
from structlog.testing import capture_logs

import stepline.engine.prefix_files as prefix_files
from stepline.actors.scheduler.warmup import Warmup
from stepline.api import Engine, SamplingParams
from stepline.engine.prefix_cache import PrefixStore
from stepline.engine.prefix_files import WRITER_THREAD_NAME, entry_file_name, model_fingerprint
from stepline.engine.runner import snapshot_cache
from stepline.engine.throttle import Throttle
from stepline.events.log import read_events
from stepline.events.models import ChunkPrefilled

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
MODELS = ["stepline-demo", "stepline-demo-hybrid"]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


SYSTEM = ids(40, 1)
FIRST = [7, *ids(5, 2)]  # the two questions differ from their first token on
SECOND = [8, *ids(5, 3)]


def open_engine(model: str, cache_dir: Path | None, **kw):
    kw = {"max_step_tokens": 16, "max_num_seqs": 4, **kw}
    return Engine.open(model, prefix_cache_dir=cache_dir, **kw)


async def run(engine: Engine, prompt, checkpoints=(), request_id=None):
    stream = await engine.submit(
        prompt, params=GREEDY, checkpoints=checkpoints, request_id=request_id
    )
    outs = [o async for o in stream]
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp.logprob for o in outs for lp in o.logprobs]
    return tokens, logprobs, outs[-1].num_cached_tokens


async def cold(model: str, prompt):
    async with Engine.open(model, prefix_cache_gb=0, max_step_tokens=16, max_num_seqs=4) as e:
        tokens, logprobs, cached = await run(e, prompt)
    assert cached == 0
    return tokens, logprobs


def same(warm, cold_run) -> None:
    assert warm[0] == cold_run[0]
    assert mx.allclose(mx.array(warm[1]), mx.array(cold_run[1]), atol=1e-4)


async def flush(engine: Engine) -> None:
    """Wait for the disk writes so far (on the executor, which owns the cache)."""
    loop = engine.step_loop
    assert await loop.executor.call(loop.runner.store.flush, 30.0)


async def settle(engine: Engine) -> None:
    """Wait until the step loop has freed ended requests (their caches retired into the
    cache) and dropped what its index let go, then for the disk writes: the cache's files
    change no more while nothing runs."""
    loop = engine.step_loop
    await wait_until(loop, lambda: loop.settled and loop.runner.num_sequences == 0)
    await flush(engine)


async def index_knows_the_files(engine: Engine) -> None:
    """Wait until the step loop's index knows every file written so far. The executor
    reports finished writes with a step's result, so a write that ended after the last
    step is unknown until the next: run one (a request cancelled at its first token,
    which leaves no entry)."""
    loop = engine.step_loop
    stream = await engine.submit([5], params=GREEDY)
    async with stream:
        async for out in stream:
            if out.token_ids:
                break
    assert loop.index is not None
    await wait_until(loop, lambda: loop.index.num_entries > loop.index.num_memory_entries)
    await settle(engine)


def first_chunk(log: Path, request_id: str) -> ChunkPrefilled:
    """The event that records where a request's cached prefix came from."""
    events = read_events(log)
    return next(e for e in events if isinstance(e, ChunkPrefilled) and e.request_id == request_id)


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def skipped(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "prefix_cache_file_skipped"]


# -- through the engine ---------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
async def test_entries_survive_an_engine_restart_and_compute_what_a_cold_run_does(
    model, model_cache_dir, tmp_path
):
    cache_dir = tmp_path / "prefix-cache"
    async with open_engine(model, cache_dir) as engine:
        await run(engine, SYSTEM + FIRST, checkpoints=(40,))
    # No waiting for the writes here: a new engine on the directory lets them land first.

    log = tmp_path / "events.jsonl"
    async with open_engine(model, cache_dir, event_log=log) as engine:
        warm = await run(engine, SYSTEM + SECOND, request_id="after-restart")
        again = await run(engine, SYSTEM + SECOND, request_id="from-memory")
    assert warm[2] == 40
    assert first_chunk(log, "after-restart").cache_source == "disk"
    assert first_chunk(log, "from-memory").cache_source == "memory"
    assert again[2] > 0
    same(warm, await cold(model, SYSTEM + SECOND))


async def test_a_truncated_file_is_skipped_with_a_warning_and_the_request_runs_cold(
    model_cache_dir, tmp_path
):
    cache_dir = tmp_path / "prefix-cache"
    async with open_engine("stepline-demo", cache_dir) as engine:
        await run(engine, SYSTEM + FIRST, checkpoints=(40,))
        await flush(engine)
    assert files(cache_dir)
    for path in files(cache_dir):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a crash mid-copy

    with capture_logs() as logs:
        async with open_engine("stepline-demo", cache_dir) as engine:
            warm = await run(engine, SYSTEM + SECOND)
            await flush(engine)
    assert warm[2] == 0
    assert skipped(logs) and all(e["log_level"] == "warning" for e in skipped(logs))
    assert all("truncated" in e["reason"] for e in skipped(logs))
    same(warm, await cold("stepline-demo", SYSTEM + SECOND))
    # The torn files are gone; the new request's own entries took their place.
    assert all(
        prefix_files.read_entry_info(p, _model_id("stepline-demo")) for p in files(cache_dir)
    )


async def test_a_file_damaged_while_the_engine_runs_is_skipped_and_the_request_runs_cold(
    model_cache_dir, tmp_path
):
    cache_dir = tmp_path / "prefix-cache"
    # No memory tier: every hit has to come from a file.
    async with open_engine("stepline-demo", cache_dir, prefix_cache_gb=0) as engine:
        # Cancelled at its first token: only its checkpoint's entry is written (a finished
        # request's own entry would supersede it, at a moment the test cannot see).
        stream = await engine.submit(SYSTEM + FIRST, params=GREEDY, checkpoints=(40,))
        async with stream:
            async for out in stream:
                if out.token_ids:
                    break
        await settle(engine)
        assert len(files(cache_dir)) == 1  # the checkpoint's entry
        await index_knows_the_files(engine)
        for path in files(cache_dir):
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF  # one flipped byte in the tensor data
            path.write_bytes(bytes(data))
        with capture_logs() as logs:
            warm = await run(engine, SYSTEM + SECOND)
    assert warm[2] == 0
    assert [e["reason"] for e in skipped(logs)] == ["its data does not match its crc32"]
    same(warm, await cold("stepline-demo", SYSTEM + SECOND))


async def test_what_the_store_reports_to_a_warm_up_step_is_handed_on(model_cache_dir, tmp_path):
    # The runner hands what the prefix store did to whichever call asks next, and a warm-up
    # step asks: a file written before it reached the step loop's index only if the warm-up
    # handed it on (on a busy machine the warm-up ran between a write and the next request,
    # and the file was never used).
    cache_dir = tmp_path / "prefix-cache"
    async with open_engine("stepline-demo", cache_dir, prefix_cache_gb=0, max_step_ms=None) as e:
        loop = e.step_loop
        store, model = loop.runner.store, e.loaded.model
        await loop.executor.call(lambda: store.put(SYSTEM, entry(model, SYSTEM)))
        assert await loop.executor.call(store.flush, 30.0)  # on disk, not yet reported
        warmup = Warmup(loop.runner, loop.config, e.vocab_size, e.max_context)
        await loop.executor.call(warmup.run)
        reports = warmup.take_prefix_reports()
        assert [info.tokens for r in reports for info in r.disk_added] == [tuple(SYSTEM)]
        assert warmup.take_prefix_reports() == []  # handed on once


async def test_disk_files_are_written_by_the_writer_thread_not_the_executor(
    model_cache_dir, tmp_path, monkeypatch
):
    writers: list[str] = []
    write = prefix_files.write_entry_file

    def recording_write(payload):
        writers.append(threading.current_thread().name)
        return write(payload)

    monkeypatch.setattr(prefix_files, "write_entry_file", recording_write)
    async with open_engine("stepline-demo-hybrid", tmp_path) as engine:
        await run(engine, SYSTEM + FIRST, checkpoints=(20, 40))
        await flush(engine)
    assert len(writers) >= 2  # at least the two checkpoints
    assert set(writers) == {WRITER_THREAD_NAME}


# -- the cache itself -----------------------------------------------------------------


def _model_id(name: str) -> str:
    from stepline.engine.models import demo_model_path

    return model_fingerprint(demo_model_path(name))


def entry(model, prompt: list[int]):
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    return snapshot_cache(cache)


def write(directory: Path, model_id: str, entries: dict[tuple[int, ...], list]) -> None:
    """Files of `entries` (tokens -> their cache), as an engine that ran before left them."""
    store = PrefixStore(disk_dir=directory, disk_max_bytes=1 << 30, model_id=model_id)
    for tokens, cache in entries.items():
        store.put(tokens, cache)
    store.close()


def restarted(directory: Path, model_id: str, disk_max_bytes: int = 1 << 30) -> Prefixes:
    """The prefix cache of an engine started on `directory`: its files are what it has."""
    return Prefixes(1 << 30, disk_dir=directory, disk_max_bytes=disk_max_bytes, model_id=model_id)


async def test_a_whole_file_whose_arrays_do_not_fit_the_model_is_dropped_with_a_warning(
    demo, tmp_path
):
    # A file with a right crc32 and token list, in the model's own name, whose arrays have
    # other shapes (and another dtype): served from, it would fail every chat, across restarts.
    cache_dir = tmp_path / "prefix-cache"
    model_id = _model_id("stepline-demo")
    crafted = []
    for i, layer in enumerate(entry(demo.model, SYSTEM)):
        keys, values, *rest = layer.state
        kv = KVCache()
        if i == 0:
            kv.state = (keys[..., :-1], values[..., :-1], *rest)  # a head_dim too small
        else:
            kv.state = (keys.astype(mx.float16), values.astype(mx.float16), *rest)
        crafted.append(kv)
    write(cache_dir, model_id, {tuple(SYSTEM): crafted})
    assert len(files(cache_dir)) == 1

    for restart in range(2):
        with capture_logs() as logs:
            async with open_engine("stepline-demo", cache_dir) as engine:
                warm = await run(engine, SYSTEM + SECOND)
                await flush(engine)
                assert engine.healthy
        same(warm, await cold("stepline-demo", SYSTEM + SECOND))
        if restart == 0:
            assert warm[2] == 0  # computed, not taken from the file
            (reason,) = [e["reason"] for e in skipped(logs)]
            assert reason.startswith("layer 0 array") and "the model's is" in reason
        else:  # the bad file is gone; the entry the first run wrote serves
            assert skipped(logs) == [] and warm[2] > 0


def test_the_size_cap_evicts_the_least_recently_used_file(demo, tmp_path):
    prompts = [[k, *ids(29, k)] for k in (10, 11, 12)]  # no prefix shared
    write(tmp_path / "probe", "m", {tuple(prompts[0]): entry(demo.model, prompts[0])})
    (size,) = [p.stat().st_size for p in files(tmp_path / "probe")]

    capped = tmp_path / "capped"
    pc = Prefixes(1 << 30, disk_dir=capped, disk_max_bytes=int(size * 2.5), model_id="m")
    a, b, c = prompts
    pc.put(a, entry(demo.model, a))
    pc.put(b, entry(demo.model, b))
    pc.flush()
    hit = pc.lookup([*a, 1])
    assert hit is not None and hit.num_tokens == 30  # a is now used more recently than b
    pc.put(c, entry(demo.model, c))
    pc.flush()
    assert pc.store.disk is not None and pc.store.disk.stats.evictions == 1
    pc.store.close()
    assert sum(p.stat().st_size for p in files(capped)) <= size * 2.5
    assert len(files(capped)) == 2

    again = restarted(capped, "m", int(size * 2.5))
    assert again.lookup([*b, 1]) is None
    for kept in (a, c):
        hit = again.lookup([*kept, 1])
        assert hit is not None and (hit.num_tokens, hit.source) == (30, "disk")


def test_after_a_restart_the_index_is_rebuilt_and_files_are_read_on_a_hit(demo, tmp_path):
    prompt = ids(50, 13)
    entries = {tuple(prompt[:n]): entry(demo.model, prompt[:n]) for n in (20, 50)}
    write(tmp_path, "m", entries)

    again = restarted(tmp_path, "m")
    again.flush()
    # One trimmable entry serves every shorter prefix: the 20-token file was redundant.
    assert again.store.disk is not None and again.store.disk.stats.entries == 1
    assert len(files(tmp_path)) == 1
    hit = again.lookup(prompt[:33] + [5, 5])
    assert hit is not None and (hit.num_tokens, hit.source) == (33, "disk")
    assert all(layer.offset == 33 for layer in hit.cache)
    hit = again.lookup(prompt[:10] + [5])
    assert hit is not None and hit.source == "memory"  # loaded once, then kept


def test_a_hybrid_file_is_used_only_at_its_own_offset(demo_hybrid, tmp_path):
    prompt = ids(50, 14)
    entries = {tuple(prompt[:n]): entry(demo_hybrid.model, prompt[:n]) for n in (20, 50)}
    write(tmp_path, "h", entries)

    again = restarted(tmp_path, "h")
    assert (hit := again.lookup(prompt[:40] + [5, 5])) is not None and hit.num_tokens == 20
    # 50 would leave nothing to compute
    assert (hit := again.lookup(prompt)) is not None and hit.num_tokens == 20
    assert (hit := again.lookup([*prompt, 5])) is not None and hit.num_tokens == 50
    assert again.lookup(prompt[:15]) is None


def test_a_file_from_another_model_is_never_used(demo, tmp_path):
    prompt = ids(30, 15)
    write(tmp_path, "model-a", {tuple(prompt): entry(demo.model, prompt)})
    (path,) = files(tmp_path)

    assert restarted(tmp_path, "model-b").lookup([*prompt, 1]) is None
    # Not even under the name our own entry for these tokens would have.
    os.replace(path, tmp_path / entry_file_name("model-b", prompt))
    ours = restarted(tmp_path, "model-b")
    assert ours.lookup([*prompt, 1]) is None
    assert ours.store.disk is not None and ours.store.disk.stats.entries == 0
    assert len(files(tmp_path)) == 1  # another model's file: left alone, not deleted


def test_models_are_told_apart_by_their_weights_not_their_names(demo, demo_hybrid):
    assert model_fingerprint(demo.path) == model_fingerprint(str(demo.path))
    assert model_fingerprint(demo.path) != model_fingerprint(demo_hybrid.path)


def test_a_file_holding_other_tokens_than_its_index_entry_is_not_used(demo, tmp_path):
    one, two = ids(30, 16), ids(30, 17)
    write(tmp_path, "m", {tuple(one): entry(demo.model, one), tuple(two): entry(demo.model, two)})
    pc = restarted(tmp_path, "m")
    # As if the two token lists hashed to one file name: one entry's file holds the other.
    os.replace(tmp_path / entry_file_name("m", two), tmp_path / entry_file_name("m", one))
    with capture_logs() as logs:
        assert pc.lookup([*one, 1]) is None
    assert "other tokens" in skipped(logs)[0]["reason"]


def test_files_are_mlx_lm_prompt_cache_files_and_keep_bfloat16(tmp_path):
    kv = KVCache()
    kv.state = (
        mx.random.normal((1, 2, 12, 8)).astype(mx.bfloat16),
        mx.random.normal((1, 2, 12, 8)).astype(mx.bfloat16),
        12,
    )
    rec = ArraysCache(2)
    rec.state = ([None, mx.random.normal((1, 3, 4)).astype(mx.bfloat16)], None, None)
    cache = [kv, rec]
    tokens = ids(12, 18)
    write(tmp_path, "m", {tuple(tokens): cache})

    (path,) = files(tmp_path)
    loaded, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata["tokens"] == ",".join(map(str, tokens))
    hit = restarted(tmp_path, "m").lookup([*tokens, 1])
    assert hit is not None and hit.source == "disk"
    for got in (loaded, hit.cache):
        for (name, want), (_, have) in zip(
            tree_flatten([c.state for c in cache]),
            tree_flatten([c.state for c in got]),
            strict=True,
        ):
            if isinstance(want, mx.array):
                assert have.dtype == mx.bfloat16 and mx.array_equal(want, have), name
            else:
                assert want == have, name


def test_failed_disk_writes_are_logged_once_a_second_with_the_count_left_out(
    demo, tmp_path, monkeypatch
):
    # A full disk fails every write (147 warnings in 40 s): the writer thread logs one a
    # second, saying how many it left out; the entries are still served from memory.
    now = [100.0]
    monkeypatch.setattr(
        prefix_files, "Throttle", lambda interval_s: Throttle(interval_s, clock=lambda: now[0])
    )

    def full_disk(payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_files, "write_entry_file", full_disk)
    prompts = [[k, *ids(9, k)] for k in range(20, 60)]
    pc = restarted(tmp_path, "m")
    with capture_logs() as logs:
        for at, batch in ((100.0, prompts[:30]), (100.5, prompts[30:35]), (101.1, prompts[35:])):
            now[0] = at
            for prompt in batch:
                pc.put(prompt, entry(demo.model, prompt))
            pc.flush()
    pc.store.close()
    failed = [e for e in logs if e["event"] == "prefix_cache_disk_io_failed"]
    assert [(e["op"], e["left_out_since_last"]) for e in failed] == [("write", 0), ("write", 34)]
    assert "No space left on device" in failed[0]["error"]
    assert pc.store.disk is not None and pc.store.disk.stats.write_errors == 40
    assert files(tmp_path) == []
    hit = pc.lookup([*prompts[0], 1])
    assert hit is not None and hit.num_tokens == 10
