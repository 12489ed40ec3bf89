"""The executor actor: the one place MLX work happens, serialised on one OS thread.

Metal command buffers must not be encoded from two threads at once, and anyio's
`to_thread.run_sync` gives no same-thread guarantee, so the executor owns one
`threading.Thread`. Callers `await executor.call(fn, ...)`: each ask carries its
own reply future; if the thread dies, every pending and later ask fails with
ExecutorDeadError (nobody waits on a reply that will never come).
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
    __slots__ = ("fn", "args", "loop", "future")

    def __init__(self, fn: Callable[..., Any], args: tuple, loop, future):
        self.fn, self.args, self.loop, self.future = fn, args, loop, future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled; nobody is waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Executor:
    """Runs callables one at a time on a dedicated thread named `stepline-executor`."""

    def __init__(self, name: str = "stepline-executor"):
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._dead: BaseException | None = None
        self._thread.start()

    @property
    def dead(self) -> BaseException | None:
        """The error that killed the executor, or None while it is healthy."""
        return self._dead

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._dead is not None:
                job.loop.call_soon_threadsafe(
                    _settle, job.future, None, ExecutorDeadError(str(self._dead))
                )
                continue
            try:
                result, error = job.fn(*job.args), None
            except BaseException as exc:  # noqa: BLE001 - reported to the caller, never lost
                result, error = None, exc
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            except RuntimeError:  # the caller's event loop is closed: nobody to tell
                pass

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the executor thread and return its result.

        Raises whatever `fn` raised, or ExecutorDeadError once the executor is dead.
        """
        if self._dead is not None:
            raise ExecutorDeadError(f"the executor died: {self._dead}")
        if not self._thread.is_alive():
            raise ExecutorDeadError("the executor thread has stopped")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put(_Job(fn, args, loop, future))
        # Shield: a cancelled caller must not leave the thread mid-job with nobody
        # owning the result; the job finishes and its result is dropped.
        return await asyncio.shield(future)

    def mark_dead(self, error: BaseException) -> None:
        """Refuse all further work (after a job failed and left MLX state unknown)."""
        if self._dead is None:
            self._dead = error
            log.error("executor_dead", error=repr(error))

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the thread after the jobs already queued."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)
