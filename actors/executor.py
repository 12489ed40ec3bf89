"""The executor actor: the one place MLX work happens, serialised on one OS thread.

Metal command buffers must not be encoded from two threads at once, and anyio's
`to_thread.run_sync` gives no same-thread guarantee, so MLX work runs on a
dedicated `threading.Thread`. Callers `await executor.call(fn, ...)`: each ask
carries its own reply future; once an executor is dead, every later ask fails
with ExecutorDeadError (nobody waits on a reply that will never come).

The thread is one per process, started on first use and never stopped: MLX keeps
per-thread state whose teardown at thread exit can abort the process (see
ml-explore/mlx#3126), and several engines in one process must not encode MLX
work concurrently either. Each Executor is still its own actor with its own
health; they only share the thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)
T = TypeVar("T")


class ExecutorDeadError(RuntimeError):
    """The executor failed; the engine cannot run any more MLX work."""


class _Job:
    __slots__ = ("owner", "fn", "args", "loop", "future", "barrier", "after")

    def __init__(self, owner, fn, args, loop, future, barrier=False, after=None):
        self.owner, self.fn, self.args, self.loop, self.future = owner, fn, args, loop, future
        self.barrier = barrier  # runs even for a dead executor: it only marks a point in the queue
        self.after = after  # run once `fn` succeeded and its caller was told


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled; nobody is waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _MLXThread:
    """The process's MLX thread: runs jobs one at a time, forever."""

    _instance: _MLXThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name="stepline-executor", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _MLXThread:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _main(self) -> None:
        while True:
            job = self.jobs.get()
            result: Any = None
            error: BaseException | None = None
            if job.owner.dead is not None and not job.barrier:
                result, error = None, ExecutorDeadError(f"the executor died: {job.owner.dead}")
            else:
                try:
                    result, error = job.fn(*job.args), None
                except BaseException as exc:  # noqa: BLE001 - reported to the caller, never lost
                    result, error = None, exc
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            except RuntimeError:  # the caller's event loop is closed: nobody to tell
                pass
            if job.after is not None and error is None and job.owner.dead is None:
                try:
                    job.after()
                except BaseException as exc:  # noqa: BLE001 - nobody waits on it: log, go on
                    log.error("executor_after_failed", error=repr(exc), exc_info=exc)
            del job, result, error  # drop MLX references here, on this thread


class Executor:
    """Runs callables one at a time on the MLX thread (named `stepline-executor`)."""

    def __init__(self) -> None:
        self._thread = _MLXThread.get()
        self._dead: BaseException | None = None

    @property
    def dead(self) -> BaseException | None:
        """The error that killed the executor, or None while it is healthy."""
        return self._dead

    @property
    def thread_id(self) -> int | None:
        return self._thread.thread.ident

    async def call(
        self, fn: Callable[..., T], *args: Any, after: Callable[[], None] | None = None
    ) -> T:
        """Run `fn(*args)` on the executor thread and return its result.

        `after`, if given, runs on the executor thread right after `fn` succeeded and its
        result was handed back, before any other job: work that follows `fn` without
        waiting for the caller to ask (nobody waits on it: what it raises is logged). It
        does not run for a dead or closed executor.
        Raises whatever `fn` raised, or ExecutorDeadError once the executor is dead.
        """
        if self._dead is not None:
            raise ExecutorDeadError(f"the executor died: {self._dead}")
        return await self._put(fn, args, barrier=False, after=after)

    async def _put(
        self, fn: Callable[..., T], args: tuple, *, barrier: bool, after: Callable | None = None
    ) -> T:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._thread.jobs.put(_Job(self, fn, args, loop, future, barrier, after))
        # A caller cancelled mid-job cancels `future`: the job still finishes on the thread,
        # and its result (or error) is dropped there (`_settle`).
        return await future

    async def drain(self, settle: Callable[[], None] | None = None) -> None:
        """Wait until every job queued so far has finished (also for a dead executor), then
        run `settle` on the thread if the executor is alive: MLX work a job started without
        waiting for it (`mx.async_eval`) is still running until MLX says it is done.

        An engine does this before it returns, so no MLX work of its is still running
        when the interpreter shuts down.
        """
        finish = settle if settle is not None and self._dead is None else (lambda: None)
        await self._put(finish, (), barrier=True)

    def mark_dead(self, error: BaseException) -> None:
        """Refuse all further work (after a job failed and left MLX state unknown)."""
        if self._dead is None:
            self._dead = error
            log.error("executor_dead", error=repr(error))

    def close(self) -> None:
        """Refuse further work. The shared thread stays: see the module docstring."""
        if self._dead is None:
            self._dead = RuntimeError("the executor is closed")
