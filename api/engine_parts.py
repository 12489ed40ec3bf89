"""How `Engine.open` assembles an engine and takes it apart again.

`EngineParts.assemble` runs the load sequence: the model (sharded across an `mlx.launch`
job's ranks with `parallel`), the runner, the memory plan and the KV budget it resolves,
the event log, the step-time model's warm-up, the prefix index (disk entries included),
and the step loop over them. Each part is kept as soon as it exists, so that `close`
takes apart whatever was built, also when a later part fails.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog

from stepline.actors import turns
from stepline.actors.executor import Executor
from stepline.actors.scheduler.core import LogPlace
from stepline.actors.scheduler.cost_model import CostModel
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_index import PrefixIndex
from stepline.actors.scheduler.spans import PromptImage
from stepline.actors.scheduler.warmup import Warmup
from stepline.actors.step_loop import ModelLimits, StepLoop
from stepline.actors.turns import Turns
from stepline.api.config import EngineConfig, EventLogConfig
from stepline.api.refusals import REFUSAL_STATUS
from stepline.engine import grammar
from stepline.events.feed import EventFeed
from stepline.events.image_files import images_dir, keep_image
from stepline.events.models import LogHeader, new_run_id, new_salt

log = structlog.get_logger(__name__)


def _is_encoder(loaded: Any) -> bool:
    """Whether the model is a non-causal encoder (engine/bert.py): no KV cache, whole prompts."""
    return loaded.embedding is not None and loaded.embedding.whole


def warn_without_openblas() -> None:
    """Say so when MLX runs on its reference BLAS (7-20x slower on Linux): it is silent
    otherwise, and the usual cause (importing mlx before stepline) is easy to fix."""
    import mlx.core  # noqa: F401 - MLX's first import is where OpenBLAS is loaded, if at all

    from stepline.engine._blas import status

    loaded, reason = status()
    if sys.platform.startswith("linux") and loaded is None and "disabled" not in reason:
        log.warning("openblas_not_loaded", reason=reason, effect="matrix products 7-20x slower")


@dataclasses.dataclass(frozen=True)
class PoolMember:
    """An engine that is one of a server's several models (api/pool.py): the event log they
    share (the pool's writer, which it closes; None: no log), where this model's events go on
    in it, and the turns the models' step loops take on the executor thread."""

    writer: Any  # events.log.EventLogWriter, or None
    place: LogPlace
    turns: Turns
    feed: EventFeed | None = None  # the pool's live readers' events (GET /v1/events)


@dataclasses.dataclass
class EngineParts:
    """An engine's parts, as far as they are built. MLX work runs on `executor` only."""

    executor: Executor
    loaded: Any = None
    runner: Any = None
    topology: Any = None  # a distributed run's place in the launch (engine/distributed.py)
    writer: Any = None  # the event log's writer
    feed: EventFeed | None = None  # the events for live readers (GET /v1/events)
    member: PoolMember | None = None  # one of several models: the writer is the pool's
    # How long `close` waits for MLX work still running; None: until it ends (see `close`).
    mlx_wait_at_close_s: float | None = None
    adapters: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> AdapterInfo

    async def assemble(
        self,
        model: str | None,
        options: EngineConfig,
        events: EventLogConfig,
        on_checkpoint: Callable | None = None,
    ) -> tuple[StepLoop, dict]:
        """Build every part; returns the step loop and the engine's config as recorded
        (the options, with the KV budget as resolved, and the distributed topology)."""
        sched = _scheduler_config(options)  # checked before anything loads: fails fast
        prefix_bytes = int(options.prefix_cache_gb * 2**30)
        loaded = await self._load(model, options)
        await self._make_runner(options, on_checkpoint, prefix_bytes)
        await self._load_adapters(options)
        exact_prefixes = self.runner.exact_prefixes  # (read before a launch wraps the runner)
        memory = await self._plan_memory(options, prefix_bytes)
        sched = dataclasses.replace(
            sched,
            max_kv_tokens=memory.max_kv_tokens,
            kv_tokens_per_seq=memory.footprint.tokens_per_seq(),
            kv_bytes_per_token=memory.footprint.bytes_per_token,
            fused_steps=self.runner.fuse,
        )
        await self._distribute()  # after the memory plan: its forward runs on every rank
        config = {
            "model": loaded.name,
            # The options as given, with the KV budget as resolved (re-execution gets the
            # same), and the topology of a distributed run.
            **options.model_copy(
                update={"max_kv_tokens": memory.max_kv_tokens, "max_kv_gb": None}
            ).model_dump(),
            "distributed": self.topology.as_config() if self.topology is not None else None,
        }
        self._open_log(events, config)
        cost_model = warmup = None
        # an encoder's steps have no decode rows for a time target to protect, nor decodes
        # for the warm-up to measure
        if options.max_step_ms is not None and not _is_encoder(loaded):
            kept, warmup = await self._warmup(sched)
            cost_model = CostModel(seed=kept)
        member = self.member
        step_loop = StepLoop(
            executor=self.executor,
            runner=self.runner,
            config=sched,
            limits=ModelLimits(
                max_context=loaded.max_context,
                eos_token_ids=frozenset(loaded.tokenizer.eos_token_ids or ()),
                exact_prefixes=exact_prefixes,
            ),
            event_log=self.writer,
            feed=self.feed,
            prefix_index=await self._prefix_index(prefix_bytes),
            cost_model=cost_model,
            warmup=warmup,
            place=member.place if member is not None else None,
            turns=member.turns if member is not None else None,
            speculative=options.speculative_config,
            refusal_status=REFUSAL_STATUS,
        )
        return step_loop, config

    async def _load(self, model: str | None, options: EngineConfig) -> Any:
        """The model, on the executor: sharded across the launch's ranks with `parallel`."""
        from stepline.engine.models import load_model  # MLX: imported only when serving

        executor = self.executor
        if options.parallel is None and self.member is not None:
            # One of several models: its tokenizer is read on another thread and its
            # weights in pieces, in its turns, so that the other models' steps go on.
            from stepline.engine.models import load_source, model_source, read_tokenizer

            source = await self._in_turn(model_source, model)
            tokenizer = await anyio.to_thread.run_sync(read_tokenizer, source.path)
            loaded = self.loaded = await self._in_turn(
                load_source, source, options.dtype, True, tokenizer
            )
            await self._eval_weights_in_turns(loaded)
        elif options.parallel is None:
            loaded = self.loaded = await executor.call(load_model, model, options.dtype)
        else:
            from stepline.engine import distributed

            loaded, self.topology = await executor.call(
                distributed.load_sharded, model, options.parallel
            )
            self.loaded = loaded
        log.info("model_loaded", model=loaded.name, path=str(loaded.path), weights=loaded.weights)
        return loaded

    async def _make_runner(
        self, options: EngineConfig, on_checkpoint: Callable | None, prefix_bytes: int
    ) -> None:
        """The model's runner (and the draft model it verifies, if any), on the executor."""
        from stepline.engine.kv_quant import kv_quant
        from stepline.engine.runner import ModelRunner

        loaded, topology, executor = self.loaded, self.topology, self.executor
        if _is_encoder(loaded):  # a BERT-family embedding model (engine/bert.py)
            from stepline.engine.bert import EncoderRunner

            if options.speculative_config is not None or topology is not None:
                raise ValueError(
                    f"{loaded.name!r} is an encoder (an embedding model): it takes no "
                    "speculative decoding and no parallel"
                )
            self.runner = await executor.call(EncoderRunner, loaded)
            return
        draft = None
        if options.speculative_config is not None:
            draft = await executor.call(_draft_model, loaded, options)
        prefix_dir = options.prefix_cache_dir
        kv = kv_quant(options.kv_bits, options.kv_group_size)
        forwards = None
        if self.member is not None:  # beside other models: a few layers a step, in turns
            forwards = await self._steps_in_turns(ModelRunner.proofs(loaded, fuse=True, kv=kv))
        self.runner = await executor.call(
            lambda: ModelRunner(
                loaded,
                seed=options.seed,
                on_checkpoint=on_checkpoint,
                prefix_cache_bytes=prefix_bytes,
                # Each rank's shards in a directory of their own.
                prefix_cache_dir=topology.prefix_cache_dir(prefix_dir)
                if topology is not None
                else prefix_dir,
                prefix_cache_disk_bytes=int(options.prefix_cache_disk_gb * 2**30),
                grammar_cache_bytes=int(options.grammar_cache_mb * 2**20),
                # Ranks > 0 may take rank 0's samples after a step (`adopt_tokens`):
                # a forward started with their own would then be wrong.
                lookahead=topology is None,
                # One forward per step is proven for one process's model, not for shards.
                fuse=topology is None,
                draft=draft,
                forwards=forwards,
                kv=kv,
            )
        )

    async def _load_adapters(self, options: EngineConfig) -> None:
        """The LoRA adapters of `options.lora`, on the executor, into the runner's model.
        Raises AdapterError for one that does not fit the model (the reason in its message)."""
        if options.adapters and options.parallel is not None:
            raise ValueError("LoRA adapters are not supported with parallel")
        for name, path in options.adapters.items():
            if name == self.loaded.name:
                raise ValueError(f"the LoRA adapter {name!r} has its base model's name")
            self.adapters[name] = await self.executor.call(self.runner.load_adapter, name, path)
            log.info(
                "adapter_loaded", model=self.loaded.name, **dataclasses.asdict(self.adapters[name])
            )

    async def _plan_memory(self, options: EngineConfig, prefix_bytes: int) -> Any:
        """The memory plan (engine/memory.py) and the KV budget it resolves, logged; its
        forward a few layers a step, in this model's turns (`_steps_in_turns`)."""
        from stepline.engine.memory import plan_memory_steps

        loaded = self.loaded
        memory = await self._steps_in_turns(
            plan_memory_steps(
                loaded.model,
                max_kv_tokens=options.max_kv_tokens,
                max_kv_gb=options.max_kv_gb,
                mlx_cache_gb=options.mlx_cache_gb,
                prefix_cache_bytes=prefix_bytes,
                kv=self.runner.kv,
                kv_cache=not _is_encoder(loaded),
            )
        )
        log.info(
            "memory_budgets",
            max_kv_tokens=memory.max_kv_tokens,
            kv_gb=round(memory.kv_budget_bytes / 2**30, 3),
            kv_bytes_per_token=memory.footprint.bytes_per_token,
            kv_bytes_per_seq=memory.footprint.bytes_per_seq,
            kv_growth_tokens=memory.footprint.growth_tokens,
            mlx_cache_gb=round(memory.buffer_cache_bytes / 2**30, 3),
        )
        return memory

    async def _distribute(self) -> None:
        """A distributed run's runner over the plain one; a rank > 0 follows rank 0 here."""
        topology = self.topology
        if topology is None:
            return
        from stepline.engine import distributed

        self.runner = await self.executor.call(distributed.DistributedRunner, self.runner, topology)
        if topology.rank > 0:
            await self.executor.call(self.runner.follow)  # ends the process when rank 0 stops

    def _open_log(self, events: EventLogConfig, config: dict) -> None:
        """The event log's writer: the pool's for one of several models, else a new run in
        `events.event_log` (a restart with the same path appends a run), or none; and the
        feed of live readers, the pool's or this run's (from memory without a log)."""
        if self.member is not None:
            self.writer, self.feed = self.member.writer, self.member.feed
            return
        header = LogHeader(
            created=time.time(),
            model=self.loaded.name,
            config=config,
            log_prompts=events.log_prompts,
            log_outputs=events.log_outputs,
            run_id=new_run_id(),
            salt=new_salt(),
        )
        if events.event_log is not None:
            from stepline.events.log import EventLogWriter

            self.writer = EventLogWriter(
                events.event_log, header, rotate_bytes=events.rotate_bytes, append=True
            )
        self.feed = EventFeed.of_log(header, self.writer, events.events_in_memory)

    async def _prefix_index(self, prefix_bytes: int) -> PrefixIndex | None:
        """The prefix cache's index, with the entries on disk; None without a cache."""
        if self.runner.store is None:
            return None
        index = PrefixIndex(prefix_bytes)
        for info in await self.executor.call(self.runner.disk_entries):
            index.add_disk(info.tokens, info.trimmable)
        return index

    @asynccontextmanager
    async def running(self, step_loop: StepLoop) -> AsyncIterator[Any]:
        """Run `step_loop` (and a distributed run's pings to the other ranks while no request
        runs) in a task group, which the block gets; at its end the loop stops and every
        request still running is cancelled."""
        async with anyio.create_task_group() as tg:
            loop_scope = anyio.CancelScope()

            async def run_loop(*, task_status=anyio.TASK_STATUS_IGNORED) -> None:
                with loop_scope:
                    await step_loop.run(task_status=task_status)

            await tg.start(run_loop)
            if self.topology is not None:
                tg.start_soon(self.runner.keep_alive, self.executor, loop_scope)
            try:
                yield tg
            finally:
                loop_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await step_loop.shutdown()  # every request still running: cancelled
                step_loop.inbox.close()

    async def _in_turn(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on the executor, in this model's turn where it is one of several
        (`PoolMember.turns`): other models' steps go on between a load's jobs."""
        if self.member is None:
            return await self.executor.call(fn, *args)
        async with self.member.turns.turn(self.member.place.model):
            return await self.executor.call(fn, *args)

    async def _steps_in_turns(self, steps: Generator[None, None, Any]) -> Any:
        """What generator `steps` returns, its steps run in this model's turns: as many a
        turn as fit `turns.LOAD_TURN_S` while another model waits for one (`steps_for_turn`),
        all of them in one job where none does or the model is alone."""
        member = self.member
        budget = turns.LOAD_TURN_S

        def others_waiting() -> bool:  # (read on the executor thread, as a warm-up reads it)
            return member is not None and member.turns.others_waiting(member.place.model)

        try:
            while True:
                done, value = await self._in_turn(
                    turns.steps_for_turn, steps, others_waiting, budget
                )
                if done:
                    return value
        finally:  # its arrays are freed on the executor thread, as every MLX object is
            with anyio.CancelScope(shield=True):
                await self.executor.call(steps.close)

    async def _eval_weights_in_turns(self, loaded: Any) -> None:
        """Compute a lazily loaded model's weights, 32 MB a step (`weights_steps`), in this
        model's turns on the executor (`_steps_in_turns`)."""
        from stepline.engine.models import weights_steps

        await self._steps_in_turns(weights_steps(loaded.model))

    async def _warmup(self, sched: SchedulerConfig) -> tuple[list, Warmup | None]:
        """The step-time model's seed: the warm-up's samples kept from an earlier start of
        the same model, budget and machine, or else the warm-up that the step loop runs
        while idle (actors/scheduler/warmup.py), to keep its samples for the next start."""
        from stepline.actors.scheduler.warmup import load_samples, samples_key
        from stepline.engine import _blas
        from stepline.engine.cache_dirs import cache_root
        from stepline.engine.prefix_files import model_fingerprint

        loaded, runner = self.loaded, self.runner
        key = samples_key(
            model=await anyio.to_thread.run_sync(model_fingerprint, loaded.path),
            weights=loaded.weights,
            max_step_tokens=sched.max_step_tokens,
            chunk_cap=sched.chunk_cap,
            max_num_seqs=sched.max_num_seqs,
            machine=(platform.node(), platform.machine(), os.cpu_count()),
            mlx=importlib.metadata.version("mlx"),
            blas=(_blas.status()[0], os.environ.get("OPENBLAS_NUM_THREADS")),
            distributed=self.topology.as_config() if self.topology is not None else None,
        )
        path = cache_root() / "warmup" / key
        samples = await anyio.to_thread.run_sync(load_samples, path)
        if samples is not None:
            log.info("warmup_samples_reused", path=str(path), samples=len(samples))
            return samples, None
        log.info("warmup_pending", kept=str(path))
        warmup = Warmup(runner, sched, loaded.vocab_size, loaded.max_context, keep_at=path)
        return [], warmup

    async def close(self) -> None:
        """Take apart what was built, in order; the executor last.

        It waits for the MLX work still running on the executor thread (the model's load, a
        warm-up step, a step) to end, or for `mlx_wait_at_close_s` at most: then that work is left
        running, and so is the prefix cache's index (the executor thread owns it), and the
        caller must end the process without the interpreter's teardown (`os._exit`), as
        `stepline serve` does. The event log is closed either way."""
        from stepline.engine.runner import mx_synchronize

        runner, executor = self.runner, self.executor
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.mlx_wait_at_close_s) as waiting:
                if self.topology is not None and runner is not None and executor.dead is None:
                    await executor.call(runner.close)  # the other ranks exit
                # The decode look-ahead may still be computing (mx.async_eval): the
                # interpreter's exit must not tear MLX down under it.
                await executor.drain(settle=mx_synchronize)
            if waiting.cancelled_caught:
                log.warning("mlx_work_left_running", waited_s=self.mlx_wait_at_close_s)
            elif runner is not None and runner.store is not None:
                # Let queued disk writes finish (file I/O only: no MLX on this thread).
                await anyio.to_thread.run_sync(runner.store.close)
        executor.close()
        if self.writer is not None and self.member is None:
            self.writer.close()


class GrammarCompiles:
    """Compiles constrained requests' grammars for `Engine.submit`, off the step loop and the
    executor: at most half the cores at once, so that a burst of complex schemas leaves the
    steps the rest (three at a time once stopped every stream on 2 cores)."""

    def __init__(self, grammars: Any):  # engine.grammar.GrammarCompiler, the runner's
        self.grammars = grammars
        self.slots = anyio.CapacityLimiter(grammar.compile_slots())

    async def compile(self, grammar_text: str) -> Any:
        """`grammar_text` compiled on a worker thread, held so that the runner's lookup at
        admission finds it (`Compiled`). Raises GrammarError for a grammar llguidance
        refuses, one that fails at its start, or one whose compile takes longer than
        `grammar.COMPILE_TIMEOUT_S` (the thread finishes it meanwhile, within
        `grammar.LIMITS`, for the cache)."""
        hit = self.grammars.find(grammar_text)  # a cache hit waits for no compile
        if hit is not None:
            return hit
        await anyio.to_thread.run_sync(self.grammars.prepare)  # once, not timed
        limit = grammar.COMPILE_TIMEOUT_S
        try:
            async with self.slots:  # the wait for a slot is not the grammar's time
                with anyio.fail_after(limit):
                    return await anyio.to_thread.run_sync(
                        self.grammars.hold, grammar_text, abandon_on_cancel=True
                    )
        except TimeoutError:
            raise grammar.GrammarError(
                f"the schema is too complex: compiling its grammar took more than {limit:g} s"
            ) from None


async def keep_images(writer: Any, images: Sequence[PromptImage]) -> None:
    """Keep a prompt's images beside the event log of `writer` (events.log.EventLogWriter or
    None), where it keeps prompts (for re-execution: `events/image_files.py`), on a worker
    thread. A failure to write is logged; the request is served."""
    if writer is None or not writer.header.log_prompts:
        return
    directory = images_dir(writer.path)

    def keep() -> None:
        for image in images:
            keep_image(directory, image.digest, image.image.data)

    try:
        await anyio.to_thread.run_sync(keep)
    except OSError as exc:
        log.warning("image_not_kept", directory=str(directory), error=repr(exc))


def _scheduler_config(options: EngineConfig) -> SchedulerConfig:
    """The scheduler's part of the options (its KV budget is the memory plan's, later)."""
    return SchedulerConfig(
        max_step_tokens=options.max_step_tokens,
        max_num_seqs=options.max_num_seqs,
        long_prefill_cap=options.long_prefill_cap,
        max_kv_tokens=options.max_kv_tokens,
        max_waiting=options.max_waiting,
        max_step_ms=options.max_step_ms,
    )


def _draft_model(loaded: Any, options: EngineConfig) -> Any:
    """Check that `loaded` can verify drafts, and load the draft model where the speculative
    config names one (same tokenizer, caches whose drafts can be taken back): its
    `DraftModel`, else None. On the executor's thread."""
    from stepline.engine.draft_model import DraftModel, check_same_tokenizer
    from stepline.engine.models import load_model
    from stepline.engine.verify import check_speculation

    spec = options.speculative_config
    assert spec is not None
    check_speculation(loaded.model)
    if spec.model is None:
        return None
    draft = load_model(spec.model, options.dtype)
    check_same_tokenizer(loaded.tokenizer, draft.tokenizer, loaded.name, draft.name)
    check_speculation(draft.model)
    log.info("draft_model_loaded", model=draft.name, path=str(draft.path), weights=draft.weights)
    return DraftModel(draft.model, loaded.vocab_size)
