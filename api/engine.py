"""The Python async API.

    async with Engine.open("stepline-demo", max_step_tokens=512) as engine:
        async for out in engine.generate(messages=[...], params=SamplingParams(max_tokens=64)):
            print(out.text, end="")

Many `generate` calls run concurrently and share each step. Leaving the loop early
(break, an exception, task cancellation) cancels the request; its cache is freed
at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from stepline.actors.executor import Executor
from stepline.actors.messages import Cancel, Submit
from stepline.actors.metrics import EngineMetrics
from stepline.actors.request import RequestActor, RequestOutput
from stepline.actors.step_loop import ModelLimits, StepLoop
from stepline.api.params import SamplingParams
from stepline.engine.policy import SchedulerConfig
from stepline.engine.prefix_index import PrefixIndex
from stepline.events.models import FinishReason, LogHeader

__all__ = ["Engine", "RequestStream", "SamplingParams"]

log = structlog.get_logger(__name__)


def _warn_without_openblas() -> None:
    """Say so when MLX runs on its reference BLAS (7-20x slower on Linux): it is silent
    otherwise, and the usual cause (importing mlx before stepline) is easy to fix."""
    import sys

    from stepline.engine._blas import status

    loaded, reason = status()
    if sys.platform.startswith("linux") and loaded is None and "disabled" not in reason:
        log.warning("openblas_not_loaded", reason=reason, effect="matrix products 7-20x slower")


class RequestStream:
    """The outputs of one request. Async-iterate it; `aclose()` (or `async with`) cancels it."""

    def __init__(self, request_id: str, outputs: MemoryObjectReceiveStream, cancel: Callable):
        self.request_id = request_id
        self._outputs = outputs
        self._cancel = cancel
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._outputs.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.finished = True
            self._outputs.close()
            raise StopAsyncIteration from None
        if out.finish_reason is not None:
            self.finished = True
            self._outputs.close()
        return out

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._cancel()
        self._outputs.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self.finished:  # dropped without being read to the end: cancel it
            self.finished = True
            try:
                self._cancel()
            except Exception:  # noqa: BLE001 - the engine may be gone already
                pass
        self._outputs.close()


class Engine:
    """One model, one step loop, one executor thread. Create with `Engine.open(...)`."""

    def __init__(self, *, loaded, step_loop: StepLoop, executor: Executor, tg, config: dict):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        self.max_context: int = loaded.max_context
        args = getattr(loaded.model, "args", None)
        self.vocab_size: int = getattr(args, "vocab_size", None) or len(loaded.tokenizer._tokenizer)
        self.config = config
        self.metrics: EngineMetrics = step_loop.metrics
        self._step_loop = step_loop
        self._executor = executor
        self._tg = tg
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: str | None = None,
        *,
        max_step_tokens: int = 512,
        max_num_seqs: int = 32,
        long_prefill_cap: int | None = None,
        max_kv_tokens: int | None = None,
        event_log: str | Path | None = None,
        event_log_rotate_bytes: int | None = None,
        log_prompts: bool = True,
        seed: int = 0,
        on_checkpoint: Callable | None = None,
        prefix_cache_gb: float = 1.0,
        prefix_cache_dir: str | Path | None = None,
        prefix_cache_disk_gb: float = 10.0,
        max_kv_gb: float | None = None,
        max_waiting: int = 1024,
        mlx_cache_gb: float | None = None,
    ) -> AsyncIterator[Engine]:
        """Load `model` (a demo name, a local mlx-lm directory or a Hugging Face id; None = the
        demo model) and serve it until the block exits.

        Raises ModelNotFoundError if the model cannot be found, ValueError for a bad config.
        `on_checkpoint(request_id, offset, cache)` runs on the executor thread.
        `prefix_cache_gb` bounds the prefix cache's memory (0 turns it off).
        `prefix_cache_dir` adds a disk tier: entries are also written there (in the
        background, as safetensors files, at most `prefix_cache_disk_gb` of them, oldest
        used evicted first) and reused by a later engine on the same model and directory.
        Memory guard: running requests' KV (prompt + max_tokens each, measured per token at
        load) must fit in `max_kv_tokens`, or `max_kv_gb` (default: 70% of the machine's
        memory less the weights and the prefix cache); requests wait until it does, and one
        that never can is refused (AdmissionError naming the numbers). `mlx_cache_gb` limits
        MLX's buffer cache (default: 10% of the machine's memory). At most `max_waiting`
        requests wait for their first chunk; past that `submit` raises QueueFullError.
        """
        if max_kv_tokens is not None and max_kv_gb is not None:
            raise ValueError("pass max_kv_tokens or max_kv_gb, not both")
        if max_kv_gb is not None and not max_kv_gb > 0:
            raise ValueError(f"max_kv_gb must be > 0, got {max_kv_gb}")
        if mlx_cache_gb is not None and not mlx_cache_gb >= 0:
            raise ValueError(f"mlx_cache_gb must be >= 0, got {mlx_cache_gb}")
        if not prefix_cache_gb >= 0:
            raise ValueError(f"prefix_cache_gb must be >= 0, got {prefix_cache_gb}")
        if not prefix_cache_disk_gb >= 0:
            raise ValueError(f"prefix_cache_disk_gb must be >= 0, got {prefix_cache_disk_gb}")
        sched = SchedulerConfig(
            max_step_tokens=max_step_tokens,
            max_num_seqs=max_num_seqs,
            long_prefill_cap=long_prefill_cap,
            max_kv_tokens=max_kv_tokens,
            max_waiting=max_waiting,
        )
        from stepline.engine.memory import plan_memory
        from stepline.engine.models import load_model  # MLX: imported only when serving
        from stepline.engine.runner import ModelRunner
        from stepline.events.log import EventLogWriter

        _warn_without_openblas()
        executor = Executor()
        writer = None
        runner = None
        try:
            loaded = await executor.call(load_model, model)
            runner = await executor.call(
                lambda: ModelRunner(
                    loaded,
                    seed=seed,
                    on_checkpoint=on_checkpoint,
                    prefix_cache_bytes=int(prefix_cache_gb * 2**30),
                    prefix_cache_dir=prefix_cache_dir,
                    prefix_cache_disk_bytes=int(prefix_cache_disk_gb * 2**30),
                )
            )
            memory = await executor.call(
                lambda: plan_memory(
                    loaded.model,
                    max_kv_tokens=max_kv_tokens,
                    max_kv_gb=max_kv_gb,
                    mlx_cache_gb=mlx_cache_gb,
                    prefix_cache_bytes=int(prefix_cache_gb * 2**30),
                )
            )
            log.info(
                "memory_budgets",
                max_kv_tokens=memory.max_kv_tokens,
                kv_gb=round(memory.kv_budget_bytes / 2**30, 3),
                kv_bytes_per_token=memory.footprint.bytes_per_token,
                kv_bytes_per_seq=memory.footprint.bytes_per_seq,
                mlx_cache_gb=round(memory.buffer_cache_bytes / 2**30, 3),
            )
            sched = dataclasses.replace(
                sched,
                max_kv_tokens=memory.max_kv_tokens,
                kv_tokens_per_seq=memory.footprint.tokens_per_seq(),
                kv_bytes_per_token=memory.footprint.bytes_per_token,
            )
            config = {
                "model": loaded.name,
                "max_step_tokens": max_step_tokens,
                "max_num_seqs": max_num_seqs,
                "long_prefill_cap": long_prefill_cap,
                "max_kv_tokens": memory.max_kv_tokens,  # resolved: re-execution gets the same
                "max_waiting": max_waiting,
                "mlx_cache_gb": mlx_cache_gb,
                "seed": seed,
                "prefix_cache_gb": prefix_cache_gb,
                "prefix_cache_dir": str(prefix_cache_dir) if prefix_cache_dir is not None else None,
                "prefix_cache_disk_gb": prefix_cache_disk_gb,
            }
            if event_log is not None:
                header = LogHeader(
                    created=time.time(), model=loaded.name, config=config, log_prompts=log_prompts
                )
                writer = EventLogWriter(event_log, header, rotate_bytes=event_log_rotate_bytes)
            eos = frozenset(loaded.tokenizer.eos_token_ids or ())
            index = None
            if runner.store is not None:
                index = PrefixIndex(int(prefix_cache_gb * 2**30))
                for info in await executor.call(runner.disk_entries):
                    index.add_disk(info.tokens, info.trimmable)
            step_loop = StepLoop(
                executor=executor,
                runner=runner,
                config=sched,
                limits=ModelLimits(max_context=loaded.max_context, eos_token_ids=eos),
                event_log=writer,
                log_prompts=log_prompts,
                prefix_index=index,
            )
            async with anyio.create_task_group() as tg:
                loop_scope = anyio.CancelScope()

                async def run_loop(*, task_status=anyio.TASK_STATUS_IGNORED) -> None:
                    with loop_scope:
                        await step_loop.run(task_status=task_status)

                await tg.start(run_loop)
                engine = cls(
                    loaded=loaded, step_loop=step_loop, executor=executor, tg=tg, config=config
                )
                try:
                    yield engine
                finally:
                    engine._closed = True
                    loop_scope.cancel()
                    with anyio.CancelScope(shield=True):
                        await step_loop.shutdown()  # every request still running: cancelled
                    step_loop.inbox.close()
        finally:
            with anyio.CancelScope(shield=True):
                await executor.drain()
                if runner is not None and runner.store is not None:
                    # Let queued disk writes finish (file I/O only: no MLX on this thread).
                    await anyio.to_thread.run_sync(runner.store.close)
            executor.close()
            if writer is not None:
                writer.close()

    # -- requests -------------------------------------------------------------

    def encode(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
    ) -> list[int]:
        """Token ids for a raw prompt, token ids, or chat messages (chat template applied)."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt= or messages=")
        if messages is not None:
            text = self.render_chat(messages)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"token id {t!r} is not in the model's vocabulary (0..{vocab - 1})"
                )
        return ids

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's rendering of `messages`. Raises ValueError on malformed messages."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_checkpoints(self, messages: Sequence[dict], ids: Sequence[int]) -> list[int]:
        """Token offsets of chat boundaries in `ids`: the end of the system prompt, the end
        of the turns before the last user message, and the end of the prompt itself.

        Found from the chat template's rendering of message prefixes; a boundary whose
        tokens are not an exact prefix of `ids` is left out, never guessed.
        """
        cuts = set()
        if messages and messages[0].get("role") in ("system", "developer"):
            cuts.add(1)
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if users and users[-1] > 0:
            cuts.add(users[-1])
        found = [len(ids)]
        for n in sorted(cuts):
            try:
                text = self.render_chat(messages[:n], add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - a template may refuse a partial chat
                continue
            prefix = self.tokenizer.encode(text, add_special_tokens=False)
            if 0 < len(prefix) < len(ids) and list(ids[: len(prefix)]) == prefix:
                found.append(len(prefix))
        return found

    async def submit(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[dict] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        checkpoints: Sequence[int] = (),
    ) -> RequestStream:
        """Admit one request and return its output stream.

        Raises ValueError for a malformed prompt or a `top_k` / stop token id outside the
        model's vocabulary, AdmissionError (EmptyPromptError,
        ContextLengthExceededError, EngineDeadError, ...) if the engine cannot serve it.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        params = params or SamplingParams()
        params.check_vocabulary(self.vocab_size)
        ids = self.encode(prompt, messages)
        room = self.max_context - len(ids)
        if 0 < room < params.max_tokens:
            # It ends at the context anyway; recording that keeps the KV guard from
            # reserving (or refusing it for) tokens it can never generate.
            params = params.model_copy(update={"max_tokens": room})
        if messages is not None:
            checkpoints = (*checkpoints, *self.chat_checkpoints(messages, ids))
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        inbox_tx, inbox_rx = anyio.create_memory_object_stream(8)
        # Sized to the most outputs a request can produce: the actor never blocks on a slow client.
        out_tx, out_rx = anyio.create_memory_object_stream[RequestOutput](
            len(ids) + params.max_tokens + 8
        )
        reply = asyncio.get_running_loop().create_future()
        submit = Submit(
            request_id=rid,
            prompt_token_ids=tuple(ids),
            params=params.to_record(),
            checkpoints=tuple(checkpoints),
            logprobs=params.logprobs,
            actor=inbox_tx,
            reply=reply,
        )
        try:
            await self._step_loop.inbox.send(submit)
            await reply
        except BaseException:
            # Cancelled at any point: a reply still pending is cancelled (the step loop then
            # skips the request); one that admitted it already gets a cancel on its heels.
            if not reply.cancel() and not reply.cancelled() and reply.exception() is None:
                self._send_cancel(rid)
            for s in (inbox_tx, inbox_rx, out_tx, out_rx):
                s.close()
            raise
        actor = RequestActor(
            rid,
            num_prompt_tokens=len(ids),
            num_cached_tokens=0,  # the step loop says otherwise when its first chunk runs
            stop=params.stop,
            decode=self.tokenizer.decode,
            inbox=inbox_rx,
            output=out_tx,
            on_end=lambda reason: self._send_cancel(rid, reason),
        )
        self._tg.start_soon(actor.run, name=f"request-{rid}")
        return RequestStream(rid, out_rx, cancel=lambda: self._send_cancel(rid))

    def _send_cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        if self._closed:
            return
        msg = Cancel(request_id, reason)
        try:
            self._step_loop.inbox.send_nowait(msg)
        except anyio.WouldBlock:
            self._tg.start_soon(self._step_loop.inbox.send, msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[dict] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        checkpoints: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they come; the last has a finish_reason.

        Raises as `submit` does, on the first iteration.
        """
        stream = await self.submit(
            prompt, messages=messages, params=params, request_id=request_id, checkpoints=checkpoints
        )
        async with stream:
            async for out in stream:
                yield out

    # -- health ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._step_loop.dead_reason is None and not self._closed

    @property
    def unhealthy_reason(self) -> str | None:
        return self._step_loop.dead_reason

    @property
    def step_loop(self) -> StepLoop:
        """For inspection and tests: the live scheduling state is `step_loop.states`; any
        recent request's state is `step_loop.state_of(request_id)`."""
        return self._step_loop
