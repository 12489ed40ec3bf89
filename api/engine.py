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
import importlib.util
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import structlog

from stepline.actors.executor import Executor
from stepline.actors.messages import (
    SHUTDOWN_MESSAGE,
    Cancel,
    EndWarmUp,
    Refuse,
    Submit,
)
from stepline.actors.metrics import EngineMetrics
from stepline.actors.request import RequestActor, RequestOutput
from stepline.actors.scheduler.admission import max_output_tokens
from stepline.actors.scheduler.spans import PromptImage
from stepline.actors.step_loop import LoopSnapshot, StepLoop
from stepline.api.adapters import ServedAdapters
from stepline.api.arrivals import Arrival, TaskArrivals
from stepline.api.config import EngineConfig, EventLogConfig, launch_rank
from stepline.api.engine_parts import (
    EngineParts,
    GrammarCompiles,
    PoolMember,
    keep_images,
    warn_without_openblas,
)
from stepline.api.params import SamplingParams
from stepline.api.prompts import Prepared, Prompts, PromptTooLongError, detokenizers
from stepline.api.request_error import RequestError
from stepline.api.stream import RequestStream
from stepline.api.submission import check_submit_args, embedding_record, request_actor
from stepline.engine.audio import no_audio
from stepline.engine.grammar import Compiled, GrammarCompiler
from stepline.engine.images import text_only
from stepline.events.models import (
    EmbedParams,
    FinishReason,
    Origin,
    RequestParams,
)

__all__ = [
    "Arrival",
    "Engine",
    "EngineClosedError",
    "WrongEventLoopError",
    "PromptTooLongError",
    "RequestStream",
    "SamplingParams",
    "launch_rank",
]

log = structlog.get_logger(__name__)

# While an engine is open, the interpreter switches threads at least this often (its default
# is every 5 ms). The executor thread needs the GIL for a little Python before each piece of
# MLX work that then runs without it (the decode look-ahead, the next step); at 5 ms it waits
# behind the event loop's commit instead of overlapping it (the hybrid demo at batch 32:
# 14.6 -> 12.0 ms a step, 2-core CPU).
SWITCH_INTERVAL_S = 0.0005


T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run `fn(*args)` to completion on a new event loop: uvloop's (a dependency where it
    builds) or else asyncio's. uvloop's scheduling is C where asyncio's is Python: the host
    CPU per generated token at batch 32 (the step loop, 32 request actors, their clients)
    measured ~25% lower on a 2-core x86 box. `stepline serve` and `generate` run on it;
    a program of your own gets the same with `uvloop.run(main())`."""
    use_uvloop = importlib.util.find_spec("uvloop") is not None
    return anyio.run(fn, *args, backend_options={"use_uvloop": use_uvloop})


class Engine:
    """One model, one step loop, one executor thread. Create with `Engine.open(...)`."""

    def __init__(
        self,
        *,
        loaded,
        step_loop: StepLoop,
        executor: Executor,
        tg,
        config: dict,
        adapters: dict[str, Any] | None = None,
    ):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self._detokenizer = detokenizers(loaded.tokenizer)  # one for each request actor
        self.model_name: str = loaded.name
        self.max_context: int = loaded.max_context
        self.vocab_size: int = loaded.vocab_size
        self.config = config
        # The LoRA adapters it serves (name -> `engine.lora.AdapterInfo`): models that share
        # its weights and batch.
        self.adapters = ServedAdapters(
            loaded.name, adapters or {}, step_loop=step_loop, executor=executor, config=config
        )
        self.metrics: EngineMetrics = step_loop.metrics
        self._step_loop = step_loop
        self._executor = executor
        self._tg = tg
        self._closed = False
        self._loop = asyncio.get_running_loop()  # the actors' mailboxes live on it
        self._stopping = False  # begin_shutdown: no new requests
        self.prompts = Prompts(
            loaded.tokenizer,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            images=loaded.vision.images if loaded.vision is not None else None,
            audio=loaded.vision.audio if loaded.vision is not None else None,
            exact_prefixes=step_loop.limits.exact_prefixes,
        )
        # Compiles constrained requests' grammars; shared with the executor's runner.
        self.grammars: GrammarCompiler = step_loop.runner.grammars
        self._compiles = GrammarCompiles(self.grammars)
        self._arrivals = TaskArrivals(self._post)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: str | None = None,
        *,
        on_checkpoint: Callable | None = None,
        mlx_wait_at_close_s: float | None = None,
        member: PoolMember | None = None,
        **options: Any,
    ) -> AsyncIterator[Engine]:
        """Load `model` (None = SmolLM2-135M-Instruct, a real instruct model from the package
        index; a demo name, a GGUF file, a local mlx-lm directory or a Hugging Face id) and
        serve it until the block exits. `options` are the fields of `EngineConfig` (how it
        schedules, remembers and budgets: `max_step_tokens`, `max_num_seqs`, `max_step_ms`,
        `prefix_cache_gb`, `dtype`, ...) and of `EventLogConfig` (`event_log=PATH`,
        `log_prompts`, ...), each documented there with its default.

        Raises ModelNotFoundError if the model cannot be found, GGUFError for a GGUF file it
        cannot serve, ValueError for a bad option (pydantic's ValidationError, naming it).
        `on_checkpoint(request_id, offset, cache)` runs on the executor thread.
        Memory guard: running requests' KV (prompt + max_tokens each, measured per token at
        load; each counted as long as the longest, as their batch pads them) must fit in
        `max_kv_tokens`, or `max_kv_gb`; requests wait until it does, and one that never can
        is refused (AdmissionError naming the numbers). At most `max_waiting` requests wait
        for their first chunk; past that `submit` raises QueueFullError. With `parallel`
        ("tensor" or "pipeline") the block runs on rank 0 only: on the other ranks `open`
        serves rank 0 and then ends the process (`os._exit`); raises DistributedError (a
        ValueError) when the model or the launch cannot be split so. The step-time model's
        warm-up samples are kept for the next start; without kept ones, the engine serves at
        once and measures them while idle (`warming_up`).

        Closing waits for the MLX work still running (the model's load, a warm-up step, a
        step: none can be interrupted), so that none runs when the interpreter tears down.
        `mlx_wait_at_close_s` is for a caller that ends the process right after the block
        with `os._exit`, as `stepline serve` does: closing then waits that long at most and
        leaves the rest running. The event log is closed either way, unless the engine is a
        pool's `member` (one of a server's several models, api/pool.py: the log is the
        pool's, and `event_log` is ignored).
        """
        log_fields = EventLogConfig.model_fields.keys() & options.keys()
        events = EventLogConfig(**{k: options.pop(k) for k in log_fields})
        config = EngineConfig(**options)
        warn_without_openblas()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, SWITCH_INTERVAL_S))
        parts = EngineParts(Executor(), mlx_wait_at_close_s=mlx_wait_at_close_s, member=member)
        try:
            step_loop, recorded = await parts.assemble(model, config, events, on_checkpoint)
            async with parts.running(step_loop) as tg:
                engine = cls(
                    loaded=parts.loaded, step_loop=step_loop, executor=parts.executor, tg=tg,
                    config=recorded, adapters=parts.adapters,
                )  # fmt: skip
                try:
                    yield engine
                finally:
                    engine._closed = True
        finally:
            await parts.close()
            sys.setswitchinterval(switch_interval)

    # -- prompts: stepline.api.prompts does the work --------------------------

    def prepare(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prepared:
        """See `Prompts.prepare`: token ids, chat checkpoints and images (CPU work, on this
        thread)."""
        return self.prompts.prepare(prompt, messages, template_kwargs)

    async def prepare_async(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prepared:
        """See `Prompts.prepare_async`: `prepare` on a worker thread."""
        return await self.prompts.prepare_async(prompt, messages, template_kwargs)

    def encode(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids for a raw prompt, token ids, or chat messages (chat template applied)."""
        return self.prompts.prepare(prompt, messages, template_kwargs).ids

    def render_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's rendering of `messages` (see `Prompts.render_chat`)."""
        return self.prompts.render_chat(messages, add_generation_prompt, template_kwargs)

    def chat_checkpoints(self, messages: Sequence[dict], ids: Sequence[int]) -> list[int]:
        """Token offsets of chat boundaries in `ids` (see `Prompts.chat_checkpoints`)."""
        return self.prompts.chat_checkpoints(messages, ids)

    @property
    def accepts_images(self) -> bool:
        """Whether the model reads images (a vision-language model): messages may hold image
        parts."""
        return self.prompts.images is not None

    @property
    def accepts_audio(self) -> bool:
        """Whether the model hears audio (it has an audio encoder): messages may hold audio
        parts."""
        return self.prompts.audio is not None

    @property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token stands for (`Prompts`)."""
        return self.prompts.max_chars_per_token

    # -- requests -------------------------------------------------------------

    async def submit(
        self,
        prompt: str | Sequence[int] | Prepared | None = None,
        *,
        messages: Sequence[dict] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        checkpoints: Sequence[int] = (),
        template_kwargs: dict[str, Any] | None = None,
        client: str | None = None,
        images: Sequence[PromptImage] = (),
        arrival: Arrival | None = None,
        embed: EmbedParams | None = None,
        adapter: str | None = None,
        door: str | None = None,
        origin: Origin = "client",
    ) -> RequestStream:
        """Admit one request and return its output stream. `template_kwargs` go to the chat
        template with `messages`; `params.grammar` constrains the output (compiled here, on a
        worker thread). `client` names who sends it (the HTTP server: a fingerprint of its API
        key and `user`; None: the one anonymous client): the running slots are shared fairly
        between clients, and one client may fill at most three quarters of the waiting queue.
        A vision model's `messages` may hold image parts (`{"type": "image", "image": <an
        image file's bytes>}`); a prompt of token ids prepared with images (`prepare`) comes
        with its `images` (`Prepared.images`); a `Prepared` prompt is taken as it is (not
        prepared again). `arrival` is this request's count from `arriving`, which ends here.
        The stream's `params` are the request's as admitted (`max_tokens` as resolved).
        With `embed` it is an embedding request (see `embed`): `params` are not used, and
        its one output is its last, with the vector (`RequestOutput.embedding`). With
        `adapter` (one of `adapters`) it runs with that LoRA adapter, in the same batch as
        the base model's requests and other adapters'. `door`: the HTTP path it came in at,
        recorded in its `admitted` event (None: the Python API). With `origin` "next-turn" it
        is the engine's own prefill of a chat's next turn (api/pipeline/next_turn.py): it runs
        only in what no client's request wants, and is cancelled when one needs its seat or KV.

        Raises TypeError or RequestError (a ValueError) naming the argument for `params`,
        `request_id`, `checkpoints`, `template_kwargs` or `client` of the wrong type or value,
        RequestError for a malformed prompt (GrammarError for a grammar that does not
        compile, fails at its start or is past `grammar.LIMITS` or `grammar.COMPILE_TIMEOUT_S`:
        too complex) or a `top_k` / stop token id outside the model's vocabulary, AdmissionError
        (EmptyPromptError, ContextLengthExceededError — PromptTooLongError when the text's
        length alone proves it —, EngineDeadError, ...) if the engine cannot serve it,
        EngineClosedError once it is closed, WrongEventLoopError when awaited on another
        event loop than the one the engine was opened on, ImageError for an image a text model
        cannot read or bytes that are not an image. The prompt is tokenized on a worker
        thread.
        """
        if self._closed or self._stopping:
            raise EngineClosedError("the engine is closed")
        if asyncio.get_running_loop() is not self._loop:
            raise WrongEventLoopError(WRONG_LOOP)
        check_submit_args(params, request_id, checkpoints, template_kwargs, client)
        self.adapters.check(adapter, embed)
        if embed is not None:  # a last-token pooling may share a prefix (a reranker's query)
            params = None
            checkpoints = checkpoints if embed.pooling == "last" else ()
        # Counted from here (or from `arriving`) until its Submit is in the step loop's inbox.
        if arrival is None or not arrival.open:
            arrival = self._arrivals.take() or Arrival(self._post)
        try:
            prepared, params, checkpoints, held = await self._prepare_submit(
                prompt, messages, params, checkpoints, template_kwargs, embedding=embed is not None
            )
            images = prepared.images or tuple(images)
            if any(i.medium == "image" for i in images) and not self.accepts_images:
                raise text_only()
            if any(i.medium == "audio" for i in images) and not self.accepts_audio:
                raise no_audio()
            if images:
                await keep_images(self._step_loop.event_log, images)
            rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
            actor = request_actor(
                rid, len(prepared.ids), params, held, self._detokenizer, self._send_cancel
            )
            submit = Submit(
                request_id=rid,
                prompt_token_ids=tuple(prepared.ids),
                params=params.to_record() if embed is None else embedding_record(embed),
                checkpoints=checkpoints,
                actor=actor if params.stop else actor.inbox,
                reply=asyncio.get_running_loop().create_future(),
                client=client,
                images=images,
                adapter=adapter,
                door=door,
                origin=origin,
            )
            admitted = await self._send(submit, arrival, actor)
        finally:
            arrival.done()
        if not params.stop:  # else the step loop drives it (`RequestActor.take`)
            self._tg.start_soon(actor.run, name=f"request-{rid}")
        return RequestStream(
            rid,
            actor.output,
            lambda message=None: self._send_cancel(rid, message=message),
            admitted,
        )

    async def load_adapter(self, name: str, path: str) -> Any:
        """Load LoRA adapter `name` from `path` (an `mlx_lm.lora` directory) while serving:
        between two steps, on the executor. Returns its `engine.lora.AdapterInfo`. Raises
        RequestError for a name in use, AdapterError (a ValueError) for an adapter that does
        not fit the model, saying why."""
        return await self.adapters.load(name, path)

    async def embed(
        self,
        prompt: str | Sequence[int] | Prepared,
        *,
        request_id: str | None = None,
        client: str | None = None,
        arrival: Arrival | None = None,
        checkpoints: Sequence[int] = (),
        door: str | None = None,
    ) -> RequestOutput:
        """The embedding of `prompt` (a text, tokenized as the model's tokenizer does with
        its special tokens, or token ids): a prefill-only request, chunked under the step
        budget like any prompt, whose final chunk pools the model body's hidden states as the
        model's sentence-transformers files say (`embedding`); nothing is sampled. Returns its
        last output: `embedding` is the vector, `finish_reason` "stop"; an output without a
        vector is one that ended otherwise (cancelled, error). A reranker's "vector" is its
        answer tokens' logits (`EmbedParams.head_tokens`). `checkpoints` (a last-token
        pooling's only): where a prompt's shared prefix ends, for the prefix cache; `door` as
        `submit`'s. Raises as `submit` does (ContextLengthExceededError for an input of more
        than `max_context - 1` tokens, saying how many this model embeds at most), and
        RequestError if the model is not an embedding model."""
        spec = self.embedding
        if spec is None:
            raise RequestError(f"{self.model_name} is not an embedding model")
        stream = await self.submit(
            prompt,
            request_id=request_id,
            client=client,
            arrival=arrival,
            embed=spec,
            checkpoints=checkpoints,
            door=door,
        )
        last: RequestOutput | None = None
        async with stream:
            async for out in stream:
                last = out
        assert last is not None, "a request's stream ends with its last output"
        return last

    @property
    def embedding(self) -> EmbedParams | None:
        """How the model pools an embedding (its sentence-transformers files); None: it is
        not an embedding model."""
        return self.loaded.embedding

    async def _send(self, submit: Submit, arrival: Arrival, actor: RequestActor) -> RequestParams:
        """Hand `submit` to the step loop and wait for its admission; returns the params as
        admitted. Raises what the step loop refused it with."""
        if self._stopping:  # shut down while this request was being prepared
            raise EngineClosedError("the engine is closed")
        reply = submit.reply
        try:
            await self._step_loop.inbox.send(submit)
            arrival.done()
            return await reply
        except BaseException:
            # Cancelled at any point: a reply still pending is cancelled (the step loop
            # then skips the request); one that admitted it already gets a cancel on its
            # heels.
            if not reply.cancel() and not reply.cancelled() and reply.exception() is None:
                self._send_cancel(submit.request_id)
            actor.close()
            raise

    async def _prepare_submit(
        self,
        prompt: str | Sequence[int] | Prepared | None,
        messages: Sequence[dict] | None,
        params: SamplingParams | None,
        checkpoints: Sequence[int],
        template_kwargs: dict[str, Any] | None,
        *,
        embedding: bool = False,
    ) -> tuple[Prepared, SamplingParams, tuple[int, ...], Compiled | None]:
        """A request's checks and token ids (see `submit`), each done once here: its
        prepared prompt (a `Prepared` one as it is), its params, its checkpoints (chat
        boundaries added) and its compiled grammar, if any. A max_tokens past the room its
        prompt leaves in the context is the scheduler core's to cut (`SchedulerCore.add`).
        A text too long for the context is refused in an `embedding`'s terms, if it is one."""
        params = params or SamplingParams()
        params.check_vocabulary(self.vocab_size)
        held = await self._compiles.compile(params.grammar) if params.grammar is not None else None
        if isinstance(prompt, Prepared):
            prepared = prompt
        else:
            try:
                prepared = await self.prepare_async(prompt, messages, template_kwargs)
            except PromptTooLongError as exc:
                if not embedding:
                    raise
                raise PromptTooLongError(
                    exc.num_prompt_tokens, exc.max_context, embedding=True
                ) from None
        return prepared, params, (*checkpoints, *prepared.checkpoints), held

    def max_output_tokens(
        self, requested: int | None, num_prompt_tokens: int, *, within_kv_budget: bool = True
    ) -> int:
        """The most tokens a request of `num_prompt_tokens` may generate here
        (`policy.max_output_tokens`): `requested` (None: as many as there is room for), cut
        to the room the context leaves after the prompt and, `within_kv_budget`, to what the
        KV budget leaves. The doors' one rule for a max_tokens they fit to the model."""
        config = self._step_loop.config if within_kv_budget else None
        return max_output_tokens(requested, num_prompt_tokens, self.max_context, config)

    def arriving(self) -> Arrival:
        """Count a request this caller is preparing (parsing, tokenizing) as on its way to the
        engine, until `submit(arrival=...)` hands it to the step loop or `arrival.done()`. An
        idle engine waits briefly (at most 30 ms) for such requests before its first step, so
        a burst's first step takes its shortest prompts. `submit` alone counts from its own
        start. A caller that does not hold the returned count ends it with `arrived()`, in
        the same task (`submit` in that task ends it too)."""
        return self._arrivals.arriving()

    def arrived(self) -> None:
        """End this task's `arriving` count, if `submit` has not (a request that failed)."""
        if (arrival := self._arrivals.take()) is not None:
            arrival.done()

    def log_refusal(self, request_id: str, message: str, *, code: str, status: int) -> None:
        """Record in the event log a request refused before it reached the engine (an HTTP
        door's 4xx: bad parameters, a body too large, an unknown model): a lone `terminal`,
        rejected, with the error's `code` and HTTP `status` and nothing of its prompt.
        Nothing without an event log, once the engine is closed, or for an id it has seen."""
        if not self._closed:
            # Recorded now, not through the inbox: the door's reply comes after it is in the log.
            self._step_loop.log_refusal(Refuse(request_id, message, code, status))

    def begin_shutdown(self) -> int:
        """Refuse new requests (`submit` raises EngineClosedError, as once closed) and cancel every
        request in flight: each ends now with `cancelled`, so open streams get their last
        frame within a step instead of being cut off when a server's grace period runs out.
        Returns how many were cancelled. Closing the engine still waits for them to end.
        The step-time model's warm-up, if it has steps left, stops at its next step."""
        self._stopping = True
        self._post(EndWarmUp())  # no MLX work of its own while the server drains
        in_flight = self.snapshot.live_ids  # the step loop cancels them
        for rid in in_flight:
            self._send_cancel(rid, message=SHUTDOWN_MESSAGE)
        return len(in_flight)

    def _send_cancel(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
    ) -> None:
        self._post(Cancel(request_id, reason, message))

    def _post(self, msg: Any) -> None:
        """Send `msg` to the step loop from synchronous code (in order, unless its inbox is
        full); nothing once the engine is closed."""
        if self._closed:
            return
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
        template_kwargs: dict[str, Any] | None = None,
        client: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they come; the last has a finish_reason.

        Raises as `submit` does, on the first iteration.
        """
        stream = await self.submit(
            prompt,
            messages=messages,
            params=params,
            request_id=request_id,
            checkpoints=checkpoints,
            template_kwargs=template_kwargs,
            client=client,
        )
        async with stream:
            async for out in stream:
                yield out

    # -- health ---------------------------------------------------------------

    @property
    def snapshot(self) -> LoopSnapshot:
        """What the step loop published after its last turn: live requests, health, warm-up."""
        return self._step_loop.snapshot

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None and not self._closed

    @property
    def busy(self) -> bool:
        """Requests in flight, or on their way (`arriving`): a server of several models never
        unloads a busy one. (The engine's own, a next turn's prefill, count: it is one short
        prefill, and an unload while it runs would cut its events short.)"""
        snapshot = self.snapshot
        return snapshot.num_live > 0 or snapshot.num_preparing > 0

    @property
    def warming_up(self) -> bool:
        """The step-time model's warm-up still has steps to measure while the engine idles
        (the first start of a model on this machine): chunks are sized by tokens alone and
        by the live steps measured so far."""
        return self.snapshot.warming_up

    @property
    def unhealthy_reason(self) -> str | None:
        dead = None if self._closed else self._executor.dead  # e.g. a rank lost while idle
        return self.snapshot.dead_reason or (f"executor failed: {dead!r}" if dead else None)

    async def wait_unhealthy(self) -> str:
        """Wait until the engine can serve no more (its executor or step loop failed);
        return why."""
        await self._step_loop.died.wait()
        return self.snapshot.dead_reason or "unknown"

    @property
    def event_log_problem(self) -> str | None:
        """Why the event log stopped writing (the engine serves on without it), or None."""
        writer = self._step_loop.event_log
        if writer is None or not writer.degraded:
            return None
        return f"{writer.error_message}; {writer.num_dropped} events dropped"

    @property
    def step_loop(self) -> StepLoop:
        """For inspection and tests: the live scheduling state is `step_loop.states`; any
        recent request's state is `step_loop.state_of(request_id)`."""
        return self._step_loop


WRONG_LOOP = (
    "the engine serves the event loop it was opened on: submit (and generate) from a task on "
    "that loop; from another thread, hand the call to it with "
    "asyncio.run_coroutine_threadsafe(..., loop)"
)


class EngineClosedError(RuntimeError):
    """The engine takes no new request: it is closed, or shutting down."""


class WrongEventLoopError(RuntimeError):
    """A request was submitted from another event loop than the engine's: its answers could
    never reach it."""
