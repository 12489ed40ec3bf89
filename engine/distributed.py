"""One model across several processes, on MLX's distributed layer (`mx.distributed`).

Launch one process per rank with `mlx.launch` (ring, JACCL, MPI). Every rank loads its
shard of the model (tensor or pipeline parallelism, from mlx-lm's `shard` / `pipeline`)
and builds the same `ModelRunner` over it. Rank 0 is the engine: its step loop calls its
runner through a `DistributedRunner`, which first broadcasts each call (`run`,
`housekeep`) to the other ranks and then runs it locally; ranks > 0 run `follow()`,
which receives the calls and runs them on their own runner, so every rank's forward (and
the collectives inside the sharded model) runs in the same order.

A broadcast is one `all_sum` of a fixed-size uint8 buffer (length + pickled call) to
which the other ranks contribute zeros, plus a second one only for calls that do not fit.
Rank 0's sampled tokens travel with its next call; the other ranks adopt them before they
run it, so every rank's cache holds the tokens rank 0 streamed even where float
rounding differs between ranks (different chips, more than two ranks summing).

Failure: MLX raises ("[ring] connection to a peer was lost") within about a second when a
peer process ends; such an error, or any error in the middle of a call (the ranks' next
collectives would no longer match), breaks the group for good: every later call raises
`RankLostError`, and the process ends itself `STEPLINE_DIST_EXIT_S` later (MLX cannot
re-form a group: only a restart of the job recovers). A peer that hangs is not an error in
MLX: its collective blocks forever. A watchdog thread bounds every call, and a follower's
wait for the next one, instead; past `STEPLINE_DIST_TIMEOUT_S` it ends the process
(`os._exit`), because a thread blocked in a collective cannot be interrupted, and the
peers then see the connection close. While no request runs, rank 0 pings the others every
`STEPLINE_DIST_PING_S`, so a lost rank is found, and a live rank 0 is not taken for a
hung one.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import structlog

from stepline.actors.scheduler.work import Housekeeping, StepResult, StepWork, is_collective_error
from stepline.engine.models import (
    AUDIO_DEMO,
    DEFAULT_DEMO,
    DEMO_MODELS,
    OMNI_DEMO,
    VISION_DEMOS,
    LoadedModel,
    demo_model_path,
)

log = structlog.get_logger(__name__)

PARALLEL_MODES = ("tensor", "pipeline")
_HEADER_BYTES = 4096  # one all_sum carries a call up to this size (a decode step's is ~1 KB)
_LEN_BYTES = 8
EXIT_HUNG = 70  # exit status of a rank whose watchdog fired


class DistributedError(ValueError):
    """The distributed engine cannot start as configured; the message says what to change."""


class RankLostError(RuntimeError):
    """The distributed group broke (a rank died, or the ranks went out of step)."""


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    backend: str  # how the job was launched: ring, jaccl, mpi, nccl
    parallel: str  # tensor or pipeline

    def as_config(self) -> dict[str, Any]:
        """What the event log's header records about the job."""
        return {"ranks": self.size, "backend": self.backend, "parallel": self.parallel}

    def prefix_cache_dir(self, base: str | Path | None) -> Path | None:
        """A directory of its own for this rank's shard of each prefix-cache entry."""
        if base is None:
            return None
        return Path(base) / f"{self.parallel}-rank{self.rank}-of-{self.size}"


def _backend_name() -> str:
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env:
        return "jaccl"
    if "MLX_HOSTFILE" in env:
        return "ring"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    if "NCCL_HOST_IP" in env:
        return "nccl"
    return "unknown"


def _supported(config: dict[str, Any]) -> tuple[str, ...]:
    """The parallel modes mlx-lm implements for this architecture, from its classes alone:
    no model is built (a refused load must leave no MLX state behind, see load_sharded)."""
    from mlx_lm.utils import _get_classes

    model_class, _ = _get_classes(config)
    module = sys.modules[model_class.__module__]
    modes = []
    if hasattr(model_class, "shard"):
        modes.append("tensor")
    # The pipeline lives on the inner model class (`model.model.pipeline`).
    inner = [c for c in vars(module).values() if isinstance(c, type) and c is not model_class]
    if any(hasattr(c, "pipeline") and c.__module__ == module.__name__ for c in inner):
        modes.append("pipeline")
    return tuple(modes)


def load_sharded(name_or_path: str | None, parallel: str) -> tuple[LoadedModel, Topology]:
    """Load this rank's shard of a model on the group of `mx.distributed.init()`.

    A demo name or a local directory is loaded lazily, split, then evaluated (so each rank
    reads only its shard's weights); a Hugging Face id goes through mlx-lm's
    `sharded_load`, which downloads only this rank's files.

    Raises DistributedError when `parallel` is not a mode, the model's architecture does
    not support it, or the job has one rank; ModelNotFoundError as `load_model` does.
    """
    from mlx_lm.utils import load_config, load_model, load_tokenizer, sharded_load

    if parallel not in PARALLEL_MODES:
        raise DistributedError(
            f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}"
        )
    name = name_or_path or DEFAULT_DEMO
    vision = f"{name} is a vision-language model: they are served on one process for now"
    if name in (*VISION_DEMOS, AUDIO_DEMO, OMNI_DEMO):
        raise DistributedError(vision)
    if name in DEMO_MODELS:
        path: Path | None = demo_model_path(name)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser().resolve()
    else:
        path = None  # a Hugging Face id
    if path is not None:
        config = load_config(path)
        if isinstance(config.get("vision_config"), dict):
            raise DistributedError(vision)
        problem = _unsupported(name, config.get("model_type", "?"), _supported(config), parallel)
        if problem is not None:
            raise DistributedError(problem)
    group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedError(
            f"--parallel {parallel} needs at least 2 ranks, but this process runs alone: start "
            "every rank with mlx.launch (e.g. `mlx.launch --backend ring -n 2 -- stepline serve "
            f"--parallel {parallel}`)"
        )
    topology = Topology(group.rank(), group.size(), _backend_name(), parallel)
    tensor_group = group if parallel == "tensor" else None
    pipeline_group = group if parallel == "pipeline" else None
    if path is None:
        try:
            model, tokenizer, config = sharded_load(
                name, pipeline_group=pipeline_group, tensor_group=tensor_group, return_config=True
            )
        except ValueError as exc:  # mlx-lm's "does not support pipelining / tensor parallelism"
            raise DistributedError(f"model {name!r}: {exc}") from exc
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(name, allow_patterns=["*.json"]))
    else:
        # What sharded_load does after its download, for a directory that has every file:
        # load lazily, split, then read only this rank's weights.
        model, config = load_model(path, lazy=True, strict=False)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        if tensor_group is not None:
            model.shard(tensor_group)
        else:
            model.model.pipeline(pipeline_group)
        mx.eval(model.parameters())
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank loaded
    max_context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=path,
        max_context=int(max_context or 4096),  # as engine.models does
    )
    log.info("sharded_model_loaded", rank=topology.rank, model=name, **topology.as_config())
    return loaded, topology


def _unsupported(name: str, arch: str, supported: tuple[str, ...], parallel: str) -> str | None:
    if parallel in supported:
        return None
    hint = (
        f"it supports {' and '.join(supported)} parallelism: use --parallel {supported[0]}"
        if supported
        else "mlx-lm implements neither tensor nor pipeline parallelism for it"
    )
    return f"model {name!r} (architecture {arch}) cannot be split by {parallel} parallelism; {hint}"


# -- bounding collectives ---------------------------------------------------------------


class Watchdog:
    """Ends the process if a guarded block runs longer than `timeout_s`.

    MLX's collectives have no timeout and a thread blocked in one cannot be interrupted;
    ending the process closes its sockets, so the other ranks fail fast instead of hanging.
    """

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._thread = threading.Thread(target=self._main, name="stepline-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._cond:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._deadline = None

    def _main(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        print(
            f"stepline: rank {self.rank}: {self._what} took over {self.timeout_s:g} s "
            "(STEPLINE_DIST_TIMEOUT_S): another rank stopped answering; ending this process",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_HUNG)


def _exit_failed() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# -- the calls ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    method: str  # "run", "housekeep", "ping" or "stop"
    args: tuple
    tokens: Mapping[str, int]  # rank 0's samples of its last step, for the others to adopt


class DistributedRunner:
    """A ModelRunner that runs on every rank of the group: rank 0 drives, the others follow.

    The step loop and the engine call it exactly as they call a ModelRunner (on the
    executor thread). Raises RankLostError from every call once the group broke.
    """

    def __init__(
        self,
        runner: Any,  # engine.runner.ModelRunner over this rank's shard
        topology: Topology,
        *,
        timeout_s: float | None = None,
        exit_grace_s: float | None = None,
    ):
        self.runner = runner
        self.loaded = runner.loaded
        self.topology = topology
        env = os.environ
        self.timeout_s = timeout_s or float(env.get("STEPLINE_DIST_TIMEOUT_S", 60))
        self.exit_grace_s = (
            exit_grace_s if exit_grace_s is not None else float(env.get("STEPLINE_DIST_EXIT_S", 5))
        )
        self.ping_s = float(env.get("STEPLINE_DIST_PING_S", 5))
        if not self.ping_s < self.timeout_s:
            raise DistributedError(
                f"STEPLINE_DIST_PING_S ({self.ping_s:g}) must be below STEPLINE_DIST_TIMEOUT_S "
                f"({self.timeout_s:g}): the other ranks take silence for a hung rank 0"
            )
        self._last_call = time.monotonic()
        self._watchdog = Watchdog(self.timeout_s, topology.rank)
        self._tokens: dict[str, int] = {}  # rank 0: samples not yet sent to the others
        self.broken: str | None = None
        self.comm_seconds = 0.0  # time spent broadcasting calls (rank 0)
        self.num_calls = 0
        self.num_adopted = 0  # tokens a rank > 0 sampled differently and took from rank 0

    @property
    def store(self) -> Any:
        """This rank's prefix-cache store: every rank's follows rank 0's index, since the
        step's work (entries to use, drop and load) reaches every rank."""
        return self.runner.store

    @property
    def grammars(self) -> Any:
        """Rank 0's grammar compiler (requests' grammars travel in their parameters)."""
        return self.runner.grammars

    def disk_entries(self) -> list:
        """Rank 0's disk tier, to seed its index (local: no collective)."""
        return list(self.runner.disk_entries())

    @property
    def num_sequences(self) -> int:
        return int(self.runner.num_sequences)

    # -- the channel ----------------------------------------------------------

    def _broadcast(self, call: _Call) -> None:
        t0 = time.perf_counter()
        blob = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        head = np.zeros(_HEADER_BYTES, dtype=np.uint8)
        head[:_LEN_BYTES] = np.frombuffer(len(blob).to_bytes(_LEN_BYTES, "little"), np.uint8)
        first = blob[: _HEADER_BYTES - _LEN_BYTES]
        head[_LEN_BYTES : _LEN_BYTES + len(first)] = np.frombuffer(first, np.uint8)
        mx.eval(mx.distributed.all_sum(mx.array(head), stream=mx.cpu))
        rest = blob[len(first) :]
        if rest:
            mx.eval(mx.distributed.all_sum(mx.array(np.frombuffer(rest, np.uint8)), stream=mx.cpu))
        self.comm_seconds += time.perf_counter() - t0
        self.num_calls += 1

    def _receive_head(self) -> bytes:
        head = mx.distributed.all_sum(mx.zeros(_HEADER_BYTES, dtype=mx.uint8), stream=mx.cpu)
        return bytes(np.array(head))

    def _receive_rest(self, head: bytes) -> _Call:
        n = int.from_bytes(head[:_LEN_BYTES], "little")
        blob = head[_LEN_BYTES : _LEN_BYTES + n]
        if n > len(blob):
            rest = mx.distributed.all_sum(mx.zeros(n - len(blob), dtype=mx.uint8), stream=mx.cpu)
            blob += bytes(np.array(rest))
        call = pickle.loads(blob)
        assert isinstance(call, _Call)
        return call

    # -- rank 0 ---------------------------------------------------------------

    def _drive(self, method: str, args: tuple) -> Any:
        if self.broken is not None:
            raise RankLostError(self.broken)
        local = getattr(self.runner, method) if method != "ping" else lambda: None
        tokens, self._tokens = self._tokens, {}
        self._last_call = time.monotonic()
        try:
            with self._watchdog.guard(method):
                self._broadcast(_Call(method, args, tokens))
                result = local(*args)
        except Exception as exc:
            self._break(exc)
            raise RankLostError(self.broken) from exc
        if isinstance(result, StepResult):
            self._tokens = dict(result.tokens)
        return result

    def _break(self, exc: BaseException) -> None:
        others = (
            "rank 1" if self.topology.size == 2 else f"one of ranks 1..{self.topology.size - 1}"
        )
        if is_collective_error(exc):
            self.broken = f"{others} is lost ({exc})"
        else:
            self.broken = f"rank 0 failed mid-call, so the ranks are out of step: {exc!r}"
        log.error("distributed_group_broken", reason=self.broken)
        atexit.register(_exit_failed)  # however the process ends now, it ends as a failure
        if self.exit_grace_s >= 0:
            threading.Thread(target=self._exit_later, name="stepline-exit", daemon=True).start()

    def _exit_later(self) -> None:
        """End the process: the group cannot be used again (SIGTERM first, for a clean stop)."""
        time.sleep(self.exit_grace_s)
        print(f"stepline: rank 0: {self.broken}; shutting down", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        os._exit(1)

    def ping(self) -> None:
        """A call that does nothing on any rank: it shows every rank still answers."""
        self._drive("ping", ())

    async def keep_alive(self, executor: Any, scope: anyio.CancelScope) -> None:
        """Ping the other ranks whenever no call went to them for `ping_s` seconds, until
        `scope` is cancelled: a rank lost while no request runs is found in bounded time,
        and the others know rank 0 still lives. A failed ping kills `executor`, so that the
        engine reports unhealthy and refuses new requests."""
        while not scope.cancel_called and self.broken is None:
            await anyio.sleep(min(self.ping_s, 0.25))
            if time.monotonic() - self._last_call >= self.ping_s and not scope.cancel_called:
                try:
                    await executor.call(self.ping)
                except RankLostError as exc:
                    executor.mark_dead(exc)
                except Exception:  # noqa: BLE001 - the executor died of something else
                    return

    def run(self, work: StepWork) -> StepResult:
        result: StepResult = self._drive("run", (work,))
        return result

    def housekeep(self, work: Housekeeping) -> StepResult:
        result: StepResult = self._drive("housekeep", (work,))
        return result

    def close(self) -> None:
        """Tell the other ranks to exit (rank 0; nothing once the group broke)."""
        if self.topology.rank != 0 or self.broken is not None:
            return
        try:
            with self._watchdog.guard("stop"):
                self._broadcast(_Call("stop", (), {}))
        except Exception as exc:  # noqa: BLE001 - the others are gone already
            log.warning("distributed_stop_failed", error=repr(exc))
        self.broken = "the engine is closed"

    # -- ranks > 0 ------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's calls until it sends stop, then end the process with status 0; when
        rank 0 is lost or a call fails here, end it with status 1. Ranks > 0 only.

        It ends the process itself (`os._exit`, after the prefix cache's disk writes): MLX's
        ring backend can abort at interpreter teardown ("terminate called without an active
        exception") after pipeline send/recv, which would turn a clean stop into a crash.
        """
        rank = self.topology.rank
        status, why = 0, "rank 0 stopped"
        while True:
            try:
                with self._watchdog.guard("waiting for rank 0 (it pings when idle)"):
                    head = self._receive_head()
                with self._watchdog.guard("a call from rank 0"):
                    call = self._receive_rest(head)
                    adopted = self.runner.adopt_tokens(call.tokens)
                    if adopted:  # float rounding differed between the ranks: rank 0 decides
                        self.num_adopted += adopted
                        log.warning("distributed_samples_adopted", rank=rank, count=adopted)
                    if call.method == "stop":
                        break
                    self._follow(call)
            except Exception as exc:
                lost = is_collective_error(exc)
                status, why = 1, f"{'rank 0 is lost' if lost else 'this rank failed'}: {exc}"
                break
        (log.info if status == 0 else log.error)("distributed_follower_exit", rank=rank, why=why)
        if status:
            print(f"stepline: rank {rank}: {why}", file=sys.stderr)
        if self.runner.store is not None:
            self.runner.store.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def _follow(self, call: _Call) -> None:
        if call.method != "ping":
            getattr(self.runner, call.method)(*call.args)
