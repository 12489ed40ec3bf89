"""A server of several models: each by name, loaded when a request first names it, unloaded
when memory is wanted for another or when it idles past its time to live.

    async with ModelPool.open(pool_config, engine_options, events) as pool:
        entry = await pool.acquire("small")     # loads it if needed; counts as arriving
        await entry.engine.submit(...)

Each loaded model is an `Engine` of its own (scheduler core, step loop, prefix cache); all
of them share the one executor thread, taking turns on it (`actors/turns.py`), and one event
log: the run's header lists the models, each event names its model, and loads and unloads
are events too (`model-loaded`, `model-load-failed`, `model-unloaded`). Which model runs
next and which stay loaded is `actors/scheduler/model_policy.py`'s decision; this module applies it.
Loads run one at a time, as tasks of the pool (a request that stops waiting does not stop
its model's load).
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from prometheus_client.core import Metric

from stepline.actors.executor import Executor
from stepline.actors.scheduler.core import LogPlace
from stepline.actors.scheduler.model_policy import DoesNotFitError, Resident, expired, to_unload
from stepline.actors.turns import Turns
from stepline.api import pool_report
from stepline.api.config import EngineConfig, EventLogConfig, ModelSpec, PoolConfig
from stepline.api.engine import Engine
from stepline.api.engine_parts import PoolMember
from stepline.api.pool_report import RunLog
from stepline.events.feed import EventFeed
from stepline.events.models import ModelLoaded, ModelUnloaded

log = structlog.get_logger(__name__)

# The share of the machine's memory all models may take together, when no --max-memory-gb.
DEFAULT_MEMORY_FRACTION = 0.7
# A model given no KV budget of its own gets this share of the server's memory budget (alone,
# an engine's default is most of the machine's memory).
DEFAULT_KV_SHARE = 0.1
# MLX's buffer cache, when no --mlx-cache-gb: this share of the budget, at most DEFAULT_CACHE_MAX.
DEFAULT_CACHE_SHARE = 0.1
DEFAULT_CACHE_MAX = 2**29
# A model whose load failed fails the requests for it this long before it is tried again.
RETRY_FAILED_LOAD_S = 30.0
# How often idle times are checked (time to live) and busy models noticed.
WATCH_EVERY_S = 1.0


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"  # its last load failed: `error` says why


class ModelUnavailableError(RuntimeError):
    """A configured model cannot serve: its load failed (the message says why)."""


class ModelTooLargeError(ValueError):
    """A model cannot fit in the server's memory budget even alone."""


@dataclass
class Entry:
    """One configured model: its state, and its engine while loaded."""

    spec: ModelSpec
    config: EngineConfig  # the server's engine options with its own over them
    state: ModelState = ModelState.UNLOADED
    engine: Engine | None = None
    served: Any = None  # what the pool's `on_load` built for it (the HTTP pipeline's part)
    footprint_bytes: int = 0  # weights + KV budget + prefix cache, as loaded
    known_bytes: int | None = None  # the footprint measured at its last load
    last_used: float = field(default_factory=time.monotonic)
    error: str | None = None  # why its last load failed
    refused: str | None = None  # why it can never load: larger than the whole budget
    users: int = 0  # requests between `acquire` and `release` (not yet in its engine's states)
    waiting: int = 0  # requests in `acquire` waiting for it to load (they keep it once loaded)
    retry_at: float = 0.0  # a failed load is tried again from then
    place: LogPlace | None = None  # where its events go on in the log
    unload: anyio.Event = field(default_factory=anyio.Event)
    unload_reason: str = "shutdown"
    # Unloaded after this many idle seconds (None: never): its spec's, else the pool's, until
    # a request's keep_alive (Ollama's, `keep_loaded`) says otherwise.
    ttl_s: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Its LoRA adapters: its spec's, and those loaded while serving (`Engine.adapters`)."""
        loaded = tuple(self.engine.adapters) if self.engine is not None else ()
        return (*self.spec.adapter_names, *(n for n in loaded if n not in self.spec.adapter_names))

    def keep_loaded(self, seconds: float | None) -> None:
        """A request's keep_alive: stay loaded this many idle seconds from now on (None:
        forever; 0: unloaded once idle). A pinned model stays loaded whatever it says."""
        self.ttl_s = seconds

    def expires_at(self) -> float | None:
        """When (time.time()) it is unloaded if no request comes; None: never."""
        if self.ttl_s is None or self.spec.pinned:
            return None
        return time.time() + (self.last_used - time.monotonic()) + self.ttl_s

    @property
    def busy(self) -> bool:
        """In use: requests hold it or wait for it (a model that just loaded stays for the
        requests that waited for it), or its engine runs some."""
        return self.users > 0 or self.waiting > 0 or (self.engine is not None and self.engine.busy)

    def resident(self) -> Resident:
        return Resident(
            self.spec.name, self.footprint_bytes, self.last_used, self.busy, self.spec.pinned
        )


@dataclass
class TurnTaking:
    """Models that cannot all fit take turns. While a load waits for room that busy models
    hold (`room_for`), a request that comes for one of those models waits behind it (unless
    pinned): the models in the way finish what they have, the loading one serves the
    requests that waited for it, then, once idle, makes room for the next."""

    room_for: Entry | None = None  # the load waiting for room
    room_seq: int = 0  # the last request that had come when it began to wait
    seq: int = 0  # counts every `acquire`

    def ticket(self) -> int:
        self.seq += 1
        return self.seq

    def yields(self, entry: Entry, seq: int) -> bool:
        """The request `seq` for the loaded `entry` waits behind another model's load."""
        room_for = self.room_for
        return (
            room_for is not None
            and room_for is not entry
            and seq > self.room_seq
            and not entry.spec.pinned
        )

    def waits_for_room(self, entry: Entry) -> bool:
        """`entry`'s load waits for room; True when it begins to."""
        if self.room_for is entry:
            return False
        self.room_for, self.room_seq = entry, self.seq
        return True

    def room_found(self, entry: Entry) -> bool:
        """`entry`'s load waits no more; True when it had waited."""
        if self.room_for is not entry:
            return False
        self.room_for = None
        return True


class ModelPool:
    """The configured models and the loaded ones' engines. Create with `ModelPool.open`. The
    HTTP pipeline's `Models` (api/pipeline/served.py)."""

    on_demand = True  # models load when asked for

    def __init__(
        self,
        config: PoolConfig,
        engine_options: dict[str, Any],
        *,
        budget_bytes: int,
        run_log: RunLog,
        tg: anyio.abc.TaskGroup,
        on_load: Callable[[Engine, ModelSpec], Any] | None,
        mlx_wait_at_close_s: float | None,
    ):
        self.config = config
        self.budget_bytes = budget_bytes
        self.cache_bytes = _cache_bytes(engine_options.get("mlx_cache_gb"), budget_bytes)
        self.entries = {
            s.name: Entry(
                s,
                _with_budgets(s.engine_config(engine_options), budget_bytes, self.cache_bytes),
                place=LogPlace(s.name),
                ttl_s=s.ttl_s or config.model_ttl_s,
            )
            for s in config.models
        }
        self.turns = Turns(tuple(self.entries))
        self.run_log = run_log  # the run's own events: refusals before a model, failed loads
        self.feed: EventFeed | None = run_log.feed  # every model's events, for live readers
        self._tg = tg
        self.on_load = on_load  # builds each model's `served` as it loads (the HTTP app sets it)
        self._mlx_wait = mlx_wait_at_close_s
        self._executor = Executor()  # the pool's own MLX work (freeing the cache) on the thread
        self._loading = anyio.Lock()  # one load at a time: each sees the others' memory
        self._changed = anyio.Event()
        self._closing = False
        self._turn = TurnTaking()

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: PoolConfig,
        engine_options: dict[str, Any] | None = None,
        events: EventLogConfig | None = None,
        *,
        on_load: Callable[[Engine, ModelSpec], Any] | None = None,
        mlx_wait_at_close_s: float | None = None,
    ) -> AsyncIterator[ModelPool]:
        """Serve `config`'s models until the block exits (each loaded on its first request;
        pinned ones at once). `engine_options`: `EngineConfig` fields for every model (each
        model's own options go over them); `events`: the one event log of them all.
        `on_load(engine, spec)` runs as each model loads (what it returns is its entry's
        `served`; what it raises fails the load). Raises ValueError for a bad option."""
        options = dict(engine_options or {})
        for spec in config.models:
            spec.engine_config(options)  # a bad option fails now, not at a first request
        run_log = RunLog.open(config, events or EventLogConfig())
        try:
            budget = await _budget_bytes(config.max_memory_gb)
            async with anyio.create_task_group() as tg:
                pool = cls(
                    config,
                    options,
                    budget_bytes=budget,
                    run_log=run_log,
                    tg=tg,
                    on_load=on_load,
                    mlx_wait_at_close_s=mlx_wait_at_close_s,
                )
                log.info(
                    "models_configured",
                    models=list(pool.entries),
                    max_memory_gb=round(budget / 2**30, 2),
                )
                tg.start_soon(pool._watch)
                for entry in pool.entries.values():
                    if entry.spec.pinned:
                        tg.start_soon(pool._load_for_pin, entry)
                try:
                    yield pool
                finally:
                    await pool._close()
                    tg.cancel_scope.cancel()
        finally:
            run_log.close()

    # -- reading ------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may send as `model` (each model's, then its aliases, then its
        LoRA adapters')."""
        return tuple(n for e in self.entries.values() for n in (*e.spec.names, *e.adapter_names))

    @property
    def listed(self) -> tuple[str, ...]:
        """Each model's first name, and each of its LoRA adapters' (a model of its own)."""
        return tuple(n for e in self.entries.values() for n in (e.name, *e.adapter_names))

    def entry_of(self, name: str) -> Entry | None:
        """The model `name` names (by its name, an alias or one of its adapters'), or None."""
        spec = self.config.spec_of(name)
        if spec is not None:
            return self.entries[spec.name]
        return next((e for e in self.entries.values() if name in e.adapter_names), None)

    def loaded(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.state is ModelState.LOADED]

    @property
    def used_bytes(self) -> int:
        """The loaded models' footprints, and MLX's buffer cache limit."""
        loaded = sum(e.footprint_bytes for e in self.entries.values() if e.engine is not None)
        return loaded + self.cache_bytes

    @property
    def models_budget_bytes(self) -> int:
        """What the models may take together: the budget less MLX's buffer cache."""
        return self.budget_bytes - self.cache_bytes

    def health(self, *, detail: bool = True) -> dict[str, Any]:
        """/health's body (`pool_report.health`); a model's error is short already."""
        return pool_report.health(self)

    def collect(self) -> Iterator[Metric]:
        """Every model's metrics, labelled (`pool_report.metrics`): a prometheus_client
        collector, `registry.register(pool)`."""
        return pool_report.metrics(self)

    # -- requests -----------------------------------------------------------------------

    def attach(
        self, build: Callable[[Engine, tuple[str, ...], ModelSpec], Any], rename: Any = ()
    ) -> None:
        """`build(engine, names, spec)` makes each model's `served`: now for those loaded (pinned
        ones, before the app existed), then as each loads. `rename` names a server of one
        model (`--served-model-name`): here each model has its own names."""
        self.on_load = lambda engine, spec: build(engine, spec.names, spec)
        for entry in self.loaded():
            if entry.engine is not None:
                entry.served = build(entry.engine, entry.spec.names, entry.spec)

    def expect(self) -> None:
        """Which model a request is for is known once its body is parsed (`acquire`)."""
        return None

    def must_wait(self, name: str) -> bool:
        """Whether `acquire(name)` waits for a load (not for a model that cannot load now)."""
        entry = self.entry_of(name)
        if entry is None or entry.refused is not None or entry.state is ModelState.LOADED:
            return False
        return not (entry.state is ModelState.FAILED and time.monotonic() < entry.retry_at)

    async def acquire(self, name: str) -> Entry:
        """The loaded model `name` names, loading it (and unloading others for room) first if
        need be. The model stays loaded for the caller until it calls `release(entry)` (by
        then its request is in the engine, or ended); the request counts as arriving at the
        engine (`Engine.arriving`). Raises KeyError for a name no model has,
        ModelTooLargeError for a model the memory budget cannot hold, ModelUnavailableError
        when its load failed, when it could not be loaded within `max_model_wait_s` (busy
        models hold the memory) or the server is shutting down."""
        entry = self.entry_of(name)
        if entry is None:
            raise KeyError(name)
        deadline = time.monotonic() + self.config.max_model_wait_s
        seq = self._turn.ticket()
        counted = False  # this request is in `entry.waiting`
        try:
            while True:
                if self._closing:
                    raise ModelUnavailableError("the server is shutting down")
                if entry.refused is not None:
                    raise ModelTooLargeError(entry.refused)
                loaded = entry.state is ModelState.LOADED and entry.engine is not None
                if loaded and not self._turn.yields(entry, seq):
                    assert entry.engine is not None
                    entry.last_used = time.monotonic()
                    entry.users += 1  # from now on never unloaded under this request
                    entry.engine.arriving()
                    return entry
                if entry.state is ModelState.FAILED and time.monotonic() < entry.retry_at:
                    raise ModelUnavailableError(entry.error or "its load failed")
                if entry.state in (ModelState.UNLOADED, ModelState.FAILED):
                    entry.state = ModelState.LOADING
                    self._tg.start_soon(self._load, entry)
                # Waiting for its load keeps it once loaded; waiting behind another model's
                # load (`TurnTaking`) must not keep it busy, or that load would wait forever.
                if counted == loaded:
                    entry.waiting += -1 if counted else 1
                    counted = not loaded
                with anyio.move_on_after(deadline - time.monotonic()):
                    await self._wait_for_change()
                if time.monotonic() >= deadline:
                    raise _waited_too_long(name, self.config.max_model_wait_s)
        finally:
            if counted:
                entry.waiting -= 1
                if entry.waiting == 0:
                    self._notify()  # a load nobody waits for any more gives up (`_make_room`)

    def adapter_loaded(self, entry: Entry, num_bytes: int) -> None:
        """A LoRA adapter of `num_bytes` was loaded into `entry`'s model while serving: its
        footprint grows by that much (measured at its next load)."""
        entry.footprint_bytes += num_bytes
        entry.known_bytes = entry.footprint_bytes

    def release(self, entry: Entry) -> None:
        """The caller of `acquire` is done with `entry` (its request is in the engine's states,
        or failed before); in the caller's task, which ends its arrival too."""
        entry.users -= 1
        entry.last_used = time.monotonic()
        if entry.engine is not None:
            entry.engine.arrived()

    async def _wait_for_change(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- loading and unloading ----------------------------------------------------------

    async def _load_for_pin(self, entry: Entry) -> None:
        if entry.state is ModelState.UNLOADED:
            entry.state = ModelState.LOADING
            await self._load(entry)

    async def _load(self, entry: Entry) -> None:
        """Load `entry` (its state is LOADING): make room, open its engine in a task of the
        pool, and settle its state (LOADED, FAILED, or UNLOADED with `error` when it can never
        fit); every waiter hears of it."""
        spec = entry.spec
        try:
            async with self._loading:
                need = entry.known_bytes or await _estimate(self._executor, entry)
                if not await self._make_room(entry, need):
                    entry.state = ModelState.UNLOADED  # the server stops, or no one waits: no load
                    return
                t0 = time.monotonic()
                log.info("model_loading", model=spec.name, source=spec.source, estimate_bytes=need)
                await self._tg.start(self._hold, entry, t0)
            await self._fit_after_load(entry)
        except DoesNotFitError as exc:
            await self._unload(entry, "memory")  # measured once loaded: larger than estimated
            entry.state, entry.refused = ModelState.UNLOADED, str(exc)
            log.warning("model_refused", model=spec.name, need=exc.need, budget=exc.budget)
        except Exception as exc:  # a load's failure is that model's: the others serve on
            entry.state, entry.engine, entry.served = ModelState.FAILED, None, None
            entry.error = f"the model {spec.name!r} could not be loaded: {_reason(exc)}"
            entry.retry_at = time.monotonic() + RETRY_FAILED_LOAD_S
            log.error("model_load_failed", model=spec.name, error=repr(exc))
            if entry.place is not None:
                entry.place = self.run_log.load_failed(entry.place, entry.error or "")
        finally:
            self._notify()

    async def _make_room(self, entry: Entry, need: int) -> bool:
        """Unload idle models until `need` fits; wait while only busy ones are in the way.
        Returns False if the pool closed meanwhile, or every request that waited for it left.
        Raises DoesNotFitError."""
        try:
            while not self._closing:
                if entry.waiting == 0 and not entry.spec.pinned:
                    log.info("model_load_abandoned", model=entry.spec.name, why="no one waits")
                    return False
                others = [e.resident() for e in self.entries.values() if e.engine is not None]
                victims = to_unload(others, need, self.models_budget_bytes, entry.spec.name)
                if victims is None:
                    if self._turn.waits_for_room(entry):
                        log.info("model_waits_for_room", model=entry.spec.name, need_bytes=need)
                    await self._wait_for_change()  # `_watch` notices models going idle
                    continue
                for name in victims:
                    await self._unload(self.entries[name], "memory")
                if victims and self.used_bytes + need > self.budget_bytes:
                    continue  # one became busy meanwhile and stayed: choose again
                return True
            return False
        finally:
            if self._turn.room_found(entry):
                self._notify()  # the requests that waited behind this load go on

    async def _fit_after_load(self, entry: Entry) -> None:
        """Once loaded, its measured footprint decides: idle models are unloaded while the
        loaded ones are over the budget. Raises DoesNotFitError if it is over it alone."""
        others = [e.resident() for e in self.entries.values() if e.engine and e is not entry]
        victims = to_unload(
            others, entry.footprint_bytes, self.models_budget_bytes, entry.spec.name
        )
        for name in victims or ():
            await self._unload(self.entries[name], "memory")
        if self.used_bytes > self.budget_bytes:
            log.warning(
                "memory_over_budget",
                used_gb=round(self.used_bytes / 2**30, 3),
                budget_gb=round(self.budget_bytes / 2**30, 3),
                why="the models in the way are busy or pinned",
            )

    async def _hold(
        self, entry: Entry, t0: float, *, task_status=anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Open `entry`'s engine, serve it until it is told to unload, then close it."""
        spec = entry.spec
        assert entry.place is not None
        member = PoolMember(self.run_log.writer, entry.place, self.turns, self.run_log.feed)
        opened = Engine.open(
            spec.source,
            member=member,
            mlx_wait_at_close_s=self._mlx_wait,
            **entry.config.open_kwargs(),
        )
        started = False
        try:
            async with opened as engine:
                entry.served = self.on_load(engine, spec) if self.on_load is not None else None
                await _measure(self._executor, engine, entry, t0, self.used_bytes)
                entry.engine, entry.state, entry.error = engine, ModelState.LOADED, None
                entry.last_used = time.monotonic()
                entry.unload = anyio.Event()
                task_status.started()
                started = True
                try:
                    await entry.unload.wait()
                finally:  # also when the server stops (cancelled): the log says so
                    _log_unloading(engine, entry)
                    engine.begin_shutdown()  # none in flight (it was idle); a late one ends now
        except Exception as exc:
            if not started:
                raise  # the load failed (`_load` says so)
            log.error("model_close_failed", model=spec.name, error=repr(exc))  # its own
        finally:
            freed, entry.footprint_bytes = entry.footprint_bytes, 0
            entry.engine = entry.served = None
            engine = opened = None  # type: ignore[assignment]  # its memory is free once unused
            if started:  # else `_load` settles its state (FAILED)
                entry.state = ModelState.UNLOADED
            with anyio.CancelScope(shield=True):
                await _free_memory(self._executor)
            if started:
                gb = round(freed / 2**30, 3)
                log.info("model_unloaded", model=spec.name, reason=entry.unload_reason, freed_gb=gb)
                self._notify()

    async def _unload(self, entry: Entry, reason: str) -> None:
        """Unload `entry` and wait until its memory is free; one that is busy now (a request
        came since it was chosen) stays, except at shutdown or after its engine failed."""
        if entry.state is not ModelState.LOADED or (
            entry.busy and reason not in ("shutdown", "failed")
        ):
            return
        entry.state, entry.unload_reason = ModelState.UNLOADING, reason
        entry.unload.set()
        while entry.state is ModelState.UNLOADING:
            await self._wait_for_change()

    def log_refusal(
        self, request_id: str, message: str, *, code: str, status: int, model: str | None
    ) -> None:
        """Record in the log a request a door refused before it reached an engine (a lone
        `terminal`, `Engine.log_refusal`): under `model`, the one it was bound to (loaded
        then), if still loaded (else nothing: it may have reached that model, whose events
        say so); refused before it was bound to any (None), under the run: model None, in a
        sequence of the run's own. Nothing without a log."""
        if model is not None:
            entry = self.entry_of(model)
            if entry is not None and entry.state is ModelState.LOADED and entry.engine is not None:
                entry.engine.log_refusal(request_id, message, code=code, status=status)
            return
        self.run_log.refusal(request_id, message, code=code, status=status)

    async def _watch(self) -> None:
        """Every WATCH_EVERY_S: a busy model is in use now (LRU), and an idle one past its time
        to live is unloaded."""
        while True:
            await anyio.sleep(WATCH_EVERY_S)
            now, ttl = time.monotonic(), {n: e.ttl_s for n, e in self.entries.items()}
            for entry in self.loaded():
                if entry.busy:
                    entry.last_used = now
            for name in expired([e.resident() for e in self.loaded()], ttl, now):
                self._tg.start_soon(self._unload, self.entries[name], "idle")
            for entry in self.loaded():
                if entry.engine is not None and entry.engine.unhealthy_reason is not None:
                    # Its executor failed: its requests ended with an error; a new request
                    # loads it again.
                    log.error(
                        "model_failed", model=entry.spec.name, reason=entry.engine.unhealthy_reason
                    )
                    entry.users = 0
                    self._tg.start_soon(self._unload, entry, "failed")
            self._notify()  # a load waiting for room looks again: a model may be idle now

    def begin_shutdown(self) -> int:
        """Refuse new requests and cancel those in flight, in every model (`Engine.
        begin_shutdown`). Returns how many were cancelled."""
        self._closing = True
        self._notify()
        return sum(e.engine.begin_shutdown() for e in self.loaded() if e.engine is not None)

    async def _close(self) -> None:
        self._closing = True
        for entry in list(self.entries.values()):
            if entry.state is ModelState.LOADED:
                await self._unload(entry, "shutdown")


async def _estimate(executor: Executor, entry: Entry) -> int:
    """The footprint `entry` will have: its weights from their files (`estimate_weights_
    bytes`), its KV budget and its prefix cache's budget."""
    from stepline.engine.models import estimate_weights_bytes

    weights = await executor.call(estimate_weights_bytes, entry.spec.model, entry.config.dtype)
    if weights is None:
        log.info("model_size_unknown", model=entry.spec.name, until="it is loaded")
    return (weights or 0) + _kv_bytes_guess(entry.config) + _prefix_bytes(entry.config)


async def _free_memory(executor: Executor) -> None:
    """Give an unloaded model's memory back: MLX's buffer cache, then the C heap."""
    import gc

    import mlx.core as mx

    from stepline.engine import heap

    gc.collect()  # an engine's parts refer to each other: freed by the collector
    try:
        await executor.call(mx.clear_cache)
        await executor.call(heap.trim)
    except Exception as exc:  # noqa: BLE001 - memory stays cached; the pool serves on
        log.warning("memory_not_freed", error=repr(exc))


async def _measure(
    executor: Executor, engine: Engine, entry: Entry, t0: float, used_bytes: int
) -> None:
    """`entry`'s footprint, once its `engine` is open (its weights, its KV budget, its prefix
    cache's), recorded in the event log (`model-loaded`) and the server log."""
    from stepline.engine.memory import weights_bytes

    spec = entry.spec
    weights = await executor.call(weights_bytes, engine.loaded.model)
    sched = engine.step_loop.config
    kv = sched.max_kv_tokens * sched.kv_bytes_per_token
    prefix = _prefix_bytes(entry.config)
    entry.footprint_bytes = entry.known_bytes = weights + kv + prefix
    seconds = time.monotonic() - t0
    engine.step_loop.log_model_event(
        ModelLoaded,
        path=str(engine.loaded.path),
        weights_bytes=weights,
        kv_bytes=kv,
        prefix_cache_bytes=prefix,
        load_seconds=round(seconds, 3),
        config=engine.config,
    )
    log.info(
        "model_loaded",
        model=spec.name,
        path=str(engine.loaded.path),
        weights_gb=round(weights / 2**30, 3),
        kv_gb=round(kv / 2**30, 3),
        prefix_cache_gb=round(prefix / 2**30, 3),
        seconds=round(seconds, 2),
        used_gb=round((used_bytes + entry.footprint_bytes) / 2**30, 3),
    )


async def _budget_bytes(max_memory_gb: float | None) -> int:
    if max_memory_gb is not None:
        return int(max_memory_gb * 2**30)
    from stepline.engine.memory import machine_memory_bytes

    return int(await Executor().call(machine_memory_bytes) * DEFAULT_MEMORY_FRACTION)


def _waited_too_long(name: str, seconds: float) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"the model {name!r} could not be loaded within {seconds:g} s: the memory it needs "
        "is held by busy models; try again later"
    )


def _cache_bytes(cache_gb: float | None, budget_bytes: int) -> int:
    """MLX's buffer cache (freed memory it keeps for reuse) is the process's: one limit for
    every model, counted once in the budget."""
    if cache_gb is not None:
        return int(cache_gb * 2**30)
    return min(int(budget_bytes * DEFAULT_CACHE_SHARE), DEFAULT_CACHE_MAX)


def _log_unloading(engine: Engine, entry: Entry) -> None:
    """The model's `model-unloaded` event, and where its events go on at its next load."""
    engine.step_loop.log_model_event(
        ModelUnloaded,
        reason=entry.unload_reason,
        bytes_freed=entry.footprint_bytes,
        idle_seconds=round(time.monotonic() - entry.last_used, 3),
    )
    entry.place = engine.step_loop.core.place


def _with_budgets(config: EngineConfig, budget_bytes: int, cache_bytes: int) -> EngineConfig:
    """`config`, with DEFAULT_KV_SHARE of the server's budget as its KV budget if it has none,
    and the server's one limit of MLX's buffer cache."""
    update: dict[str, Any] = {"mlx_cache_gb": cache_bytes / 2**30}
    if config.max_kv_gb is None and config.max_kv_tokens is None:
        update["max_kv_gb"] = budget_bytes * DEFAULT_KV_SHARE / 2**30
    return config.model_copy(update=update)


def _kv_bytes_guess(config: EngineConfig) -> int:
    """The KV budget a model will have before its footprint per token is measured: its
    max_kv_gb (a server of several models wants one per model, else the KV is measured at
    load), else nothing yet."""
    return int((config.max_kv_gb or 0) * 2**30)


def _prefix_bytes(config: EngineConfig) -> int:
    return int(config.prefix_cache_gb * 2**30)


def _reason(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__
