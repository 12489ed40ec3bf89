"""The MLX work of one step, on the executor's thread only: a step is `prepare` (where each
row decodes, the look-ahead taken) -> forward -> sample -> results (tokens into each request,
rows joining and leaving, the next look-ahead), as nano-vllm's `ModelRunner.run` and
mlx-lm's `GenerationBatch._step` read.

Each request prefills into its own mlx-lm prompt cache; when its prompt is done the cache
is merged into the decode batch (`engine/decode_batch.py`, with mlx-lm's own
`merge`/`extend`/`filter`/`extract`). How the model runs a step's tokens is decided once
per model (`engine/step.py`: a forward each, or fused into one where the architecture
allows). The batch's next forward is built as a step ends and computed while the step loop
commits it (`engine/lookahead.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import structlog

from stepline.actors.scheduler.plan import ScheduledEncode, StepPlan
from stepline.actors.scheduler.spans import prompt_key
from stepline.actors.scheduler.work import (
    ADMISSION_FAILED,
    ENCODE_FAILED,
    GRAMMAR_FAILED,
    VERIFY_FAILED,
    Housekeeping,
    NewRequest,
    PrefixReport,
    StepResult,
    StepWork,
    TokenLogprob,
    is_collective_error,
)
from stepline.engine import cpu_attention, experts, gated_delta, step_sampling
from stepline.engine.constraints import advance
from stepline.engine.decode_batch import DecodeBatch
from stepline.engine.draft_model import DraftModel
from stepline.engine.embed import EmbedChunks, is_embedding_chunk
from stepline.engine.forward import run_to_end
from stepline.engine.grammar import DEFAULT_CACHE_BYTES, GrammarCompiler
from stepline.engine.kv_quant import KVQuant, check_model, make_cache
from stepline.engine.lookahead import LookAhead
from stepline.engine.lora import AdapterInfo, Adapters
from stepline.engine.memory import read_memory_counters
from stepline.engine.models import LoadedModel
from stepline.engine.prefix_cache import PrefixStore, compact_cache, exact_only, share_cache
from stepline.engine.prefix_files import model_cache_layout, model_fingerprint
from stepline.engine.sampling import RowHistory, RowSampling, Sampler
from stepline.engine.sequences import Cache, Seq
from stepline.engine.step import Kind, Step, forwards_kind_steps, sample
from stepline.engine.step_sampling import Fail
from stepline.engine.verify import Verify, verify_rows

log = structlog.get_logger(__name__)

# Called on the executor thread when prefill reaches a checkpoint:
# (request_id, offset, snapshot of that request's cache at exactly offset tokens).
CheckpointHook = Callable[[str, int, Cache], None]


def mx_synchronize() -> None:
    """Wait until MLX has finished all the work it was given (on the executor thread)."""
    mx.synchronize()


def snapshot_cache(cache: Cache) -> Cache:
    """An independent, evaluated copy of a per-request cache (any mlx-lm cache kind) that
    owns exactly its tokens: what the prefix store keeps, so storing it copies nothing more
    (see `prefix_cache.compact_cache`)."""
    return compact_cache(cache)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        seed: int = 0,
        on_checkpoint: CheckpointHook | None = None,
        prefix_cache_bytes: int = 0,
        prefix_cache_dir: str | Path | None = None,
        prefix_cache_disk_bytes: int = 0,
        grammars: GrammarCompiler | None = None,
        grammar_cache_bytes: int = DEFAULT_CACHE_BYTES,
        lookahead: bool = True,
        fuse: bool = True,
        draft: DraftModel | None = None,
        forwards: Kind | None = None,
        kv: KVQuant | None = None,
    ):
        """Raises KVQuantError where `kv` cannot quantize this model's KV (before anything
        else is set up)."""
        check_model(loaded.model, kv)
        self.kv = kv  # how the attention layers' KV is held (`engine/kv_quant.py`)
        self.draft = draft  # a draft model's drafts (engine/draft_model.py); None: the plan's
        self.loaded = loaded
        self.sampler = Sampler(seed=seed)
        self.on_checkpoint = on_checkpoint
        # The prefix cache's arrays; which entry serves whom is the step loop's index's call.
        self.store: PrefixStore | None = None
        if prefix_cache_bytes > 0 or prefix_cache_dir is not None:
            self.store = PrefixStore(
                disk_dir=prefix_cache_dir,
                disk_max_bytes=prefix_cache_disk_bytes,
                # Files are only ever used for the same weights (checked on every read),
                # and only if their arrays fit the model's cache (checked on every load).
                model_id=model_fingerprint(loaded.path, kv) if prefix_cache_dir is not None else "",
                layout=model_cache_layout(loaded.model, kv)
                if prefix_cache_dir is not None
                else None,
            )
        # a prefix of its cache serves only at its own offset (`prefix_cache.exact_only`)
        self.exact_prefixes = exact_only(loaded.model)
        self._seqs: dict[str, Seq] = {}
        self._checkpointed: list[Seq] = []  # requests that reached a checkpoint this step
        # How the model runs a step's tokens, decided once (`engine/step.py`): proven here,
        # or beforehand a few layers at a time (`proofs`, for a model loading beside others).
        kind, split_head = forwards or run_to_end(self.proofs(loaded, fuse=fuse, kv=kv))
        self.fuse = kind.fuses  # a step's chunks and decode rows share one forward
        # The decode batch's caches are kept in groups of similar lengths where steps fuse.
        self.batch = DecodeBatch(split=self.fuse)
        # LoRA adapters in the model's layers; each forward routes its rows to theirs.
        self.adapters = Adapters(loaded.model)
        self.forwards = kind(
            loaded, self._seqs, self.batch, self._checkpoint, split_head, self.adapters.routes
        )
        # embedding requests' chunks: the body's forward, pooled (`engine/embed.py`)
        self.embeds = EmbedChunks(self._checkpoint)
        self.lookahead = LookAhead(
            self.batch, self.forwards, self.sampler, enabled=lookahead, fused_steps=self.fuse
        )
        self.grammars = grammars or GrammarCompiler(
            loaded.tokenizer, loaded.vocab_size, max_bytes=grammar_cache_bytes
        )

    @staticmethod
    def proofs(
        loaded: LoadedModel, *, fuse: bool = True, kv: KVQuant | None = None
    ) -> Generator[None, None, Kind]:
        """What a runner's build checks on the model, a few layers of a forward at a time (it
        yields after each, `forward.evaluated`): the `forwards` argument of a runner of
        `loaded` built with the same `fuse` and `kv`."""
        # Prompt attention in cache-sized blocks on the CPU (before `fused` wraps it too).
        cpu_attention.install(loaded.model)
        # Gated DeltaNet's prompt recurrence in blocks of matrix products on the CPU.
        gated_delta.install(loaded.model)
        # A mixture's experts, one matrix product each over the tokens routed to it.
        experts.install()
        media = loaded.vision is not None  # its media chunks fused too, where proven
        return (yield from forwards_kind_steps(loaded.model, fuse=fuse, kv=kv, media=media))

    @property
    def model(self) -> Any:  # an mlx-lm model
        """The model the step's forwards run (one owner: `Forwards.model`; set it to wrap
        the model, as tests and benchmarks do)."""
        return self.forwards.model

    @model.setter
    def model(self, model: Any) -> None:
        self.forwards.model = model

    # -- request lifecycle ----------------------------------------------------

    def _admit(self, new: NewRequest) -> None:
        p = new.params
        self.adapters.routes.slot(new.adapter)  # KeyError: unloaded since it was submitted
        sampling = RowSampling(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            repeat_last_n=p.repeat_last_n,
            logprobs=p.logprobs,
        )
        seq = self._seqs[new.request_id] = Seq(
            request_id=new.request_id,
            prompt=mx.array(new.prompt_token_ids, dtype=mx.int32),
            sampling=sampling,
            history=RowHistory(new.prompt_token_ids) if sampling.needs_history else None,
            cache=self._start_cache(new),
            params=p,
            constraint=self.grammars.matcher(p.grammar) if p.grammar is not None else None,
            images=new.images,
            key=(
                prompt_key(new.prompt_token_ids, new.images, new.adapter)
                if new.images or new.adapter is not None
                else None
            ),
            own_checkpoint=new.own_checkpoint,
            adapter=new.adapter,
        )
        if new.images and self.loaded.vision is not None:  # where a model's are 3-D
            inputs = [image.inputs for image in new.images]
            found = self.loaded.vision.encoder.positions(new.prompt_token_ids, inputs)
            if found is not None:
                seq.positions, seq.rope_delta = found

    def _start_cache(self, new: NewRequest) -> Cache:
        if new.prefix is None or self.store is None:
            return make_cache(self.model, self.kv)
        return self.store.get(new.prefix, new.num_cached_tokens)

    def _retire(self, seq: Seq) -> None:
        """Offer a finished request's cache for reuse: its prompt and the tokens it made, all
        but the last one unless the forward looking ahead has taken that one in too."""
        if self.store is None or seq.num_generated < 1:
            return
        if seq.cache is not None:  # it ended at its first token, never joining the batch
            cache, fed = seq.cache, seq.output[:-1]
        else:
            cache = self.batch.extract(seq.request_id)
            fed = seq.output if self.batch.ahead is not None else seq.output[:-1]
        tokens = [*seq.key_of(seq.prompt.shape[0]), *seq.keyed(fed)]
        # Every layer that counts tokens must hold exactly these (a wrapped sliding window
        # does not: it lost its oldest tokens, and cannot serve as a prefix of anything).
        offsets = {c.offset for c in cache if isinstance(getattr(c, "offset", None), int)}
        if offsets <= {len(tokens)} and all(
            getattr(c, "max_size", len(tokens) + 1) > len(tokens) for c in cache
        ):
            self.store.put(tokens, cache)

    def _free(self, request_ids: Sequence[str], retire: frozenset[str] = frozenset()) -> None:
        for rid in request_ids:
            if rid in retire and rid in self._seqs:
                self._retire(self._seqs[rid])
        gone = {rid for rid in request_ids if self._seqs.pop(rid, None) is not None}
        if self.draft is not None:
            for rid in gone:
                self.draft.forget(rid)
        self.batch.remove(gone)
        if not self.batch.rows:
            self.lookahead.drop()

    def _encode(self, work: ScheduledEncode) -> None:
        """Units of the encoder's work for one image (or clip) of a request's prompt."""
        from stepline.engine.vision.parts import EncodeJob

        seq = self._seqs[work.request_id]
        job = seq.encodes.get(work.image)
        if job is None:
            image = seq.images[work.image]
            span = seq.prompt[image.start : image.end]
            job = seq.encodes[work.image] = EncodeJob(span, image.inputs, image.units)
        self.loaded.vision.encoder_of(seq.images[work.image].medium).run(job, work.start, work.end)

    def housekeep(self, work: Housekeeping) -> StepResult:
        """Free ended requests, drop and load prefix-cache entries; no forward pass."""
        t0 = time.perf_counter()
        self._housekeep(work)
        return StepResult(seconds=time.perf_counter() - t0, prefix=self._prefix_report())

    def _housekeep(self, work: Housekeeping) -> None:
        if self.store is not None:
            for tokens in work.drop_entries:
                self.store.drop(tokens)
            for tokens in work.promote:
                self.store.promote(tokens)
        self._free(work.free, work.retire)

    def _checkpoint(self, seq: Seq, end: int, cache: Cache | None = None) -> None:
        """Snapshot `seq`'s cache at `end` prompt tokens (`cache`: its cache at `end`, taken
        inside a fused forward that went on past it; None: its cache now): the prefix cache,
        then the hook."""
        if not seq.checkpoints:
            self._checkpointed.append(seq)
        seq.checkpoints.append(end)
        snapshot = snapshot_cache(seq.cache if cache is None else cache)
        if self.store is not None:
            self.store.put(seq.key_of(end), snapshot)
        if self.on_checkpoint is not None and end != seq.own_checkpoint:
            self.on_checkpoint(seq.request_id, end, share_cache(snapshot))

    # -- one step -------------------------------------------------------------

    def run(self, work: StepWork) -> StepResult:
        """Run one step. A fault pinned on one request (its set-up, its prefill chunk, its
        checkpoint, its sampling row) drops that request and is reported in
        `StepResult.failed`; the rest of the step goes on. Any other fault (the batched
        decode forward, evaluating a fused forward, the plan disagreeing with the batch)
        raises."""
        # The step's time includes the look-ahead that started its decode.
        t0 = time.perf_counter() - self.lookahead.take_seconds()
        self._housekeep(work)
        self.lookahead.raise_failed()  # the batch's look-ahead forward failed
        failed: dict[str, str] = {}
        fail: Fail = partial(self._fail, failed)
        self._set_up(work, failed, fail)
        embeddings = self.embeds.run(self.model, work.plan.chunks, self._seqs, failed, fail)
        step = self._prepare(self._without_embeddings(work.plan), failed, fail)
        out = self.forwards.run(step, failed, fail)
        tokens: dict[str, int] = {}
        drafted = verify_rows(
            self.model,
            self.sampler,
            step.solo,
            out.apart,
            tokens,
            failed,
            fail,
            self.adapters.routes,
        )
        if self.draft is not None:
            for v in step.solo:
                self.draft.trim(v.seq)
        # final chunks, in the plan's order: (request, last-position logits)
        finals = [
            (self._seqs[c.request_id], out.finals[c.request_id])
            for c in work.plan.chunks
            if c.request_id in out.finals and c.request_id not in failed
        ]
        pipelined, started = self._pipeline(step)
        sampled, array = sample(self.sampler, finals, step, out.decoded, fail, pipelined=pipelined)
        logprobs: dict[str, TokenLogprob] = {}
        self._record(sampled, tokens, logprobs, failed)
        if step.rows:  # the batch's rows come after the finals'
            self.batch.took(step.rows, array)
        self._finish(step, finals, failed, started)
        return StepResult(
            tokens=tokens,
            drafted=drafted,
            logprobs=logprobs,
            checkpoints=self._checkpoints(),
            seconds=time.perf_counter() - t0,
            prefix=self._prefix_report(),
            failed=failed,
            memory=read_memory_counters(),
            embeddings=embeddings,
        )

    def _without_embeddings(self, plan: StepPlan) -> StepPlan:
        """`plan` without the embedding requests' chunks (`EmbedChunks` ran them)."""
        chunks = tuple(c for c in plan.chunks if not is_embedding_chunk(c, self._seqs))
        return plan if len(chunks) == len(plan.chunks) else dataclasses.replace(plan, chunks=chunks)

    def _checkpoints(self) -> dict[str, tuple[int, ...]]:
        """The checkpoints each live request reached this step."""
        out: dict[str, tuple[int, ...]] = {}
        for seq in self._checkpointed:
            rid, reached = seq.request_id, tuple(seq.checkpoints)
            if reached and self._seqs.get(rid) is seq:
                out[rid] = reached
        return out

    def _set_up(self, work: StepWork, failed: dict[str, str], fail: Fail) -> None:
        """The step's new requests, then its encoder work (a fault is that request's)."""
        for new in work.admit:
            try:
                self._admit(new)
            except Exception as exc:
                fail(new.request_id, ADMISSION_FAILED, exc)
        for encode in work.plan.encodes:
            if encode.request_id in failed:
                continue
            try:
                self._encode(encode)
            except Exception as exc:
                fail(encode.request_id, ENCODE_FAILED, exc)

    def _prepare(self, plan: StepPlan, failed: dict[str, str], fail: Fail) -> Step:
        """Where the plan's rows decode (rows moved into or out of the batch now, or after
        the step where its forward was built ahead), their drafts, the look-ahead taken."""
        placement = self.batch.place(plan, self._seqs)
        self.batch.move(placement.before, self._seqs)
        self.batch.check(plan, placement.drafting)
        solo = [
            Verify(self._seqs[rid], d) for rid, d in placement.drafting.items() if rid not in failed
        ]
        if self.draft is not None:
            solo = self.draft.fill(solo, lambda rid, exc: fail(rid, VERIFY_FAILED, exc))
        for seq in self._checkpointed:
            seq.checkpoints.clear()
        self._checkpointed = []
        rows = self.batch.rows
        return Step(plan, placement, rows, self.lookahead.take(rows), solo)

    def _pipeline(self, step: Step) -> tuple[bool, mx.array | None]:
        """Whether the next forward is built on this step's tokens before they are read
        (a decode-only step: `LookAhead.pipeline`), and that forward (None if it could not be
        built); any other step is not one whose period `LookAhead.order` measures."""
        if step.ahead is None or not self.lookahead.pipelines(step):
            self.lookahead.order.interrupt()
            return False, None
        return True, self.lookahead.decode_only(step.ahead, step.rows)

    def _finish(
        self,
        step: Step,
        finals: list[tuple[Seq, mx.array]],
        failed: Mapping[str, str],
        started: mx.array | None,
    ) -> None:
        """After the step: finished prompts join the batch, rows held in place move, and
        the batch's next forward is built (`started`: already, on this step's tokens)."""
        # A request that ended at its first token (max_tokens=1: asked for, or all the room
        # its prompt left in the context) never joins: merging its cache would pad every row
        # to its length. A drafting one decodes on its own cache until it stops drafting.
        self.batch.join(
            [
                seq
                for seq, _ in finals
                if seq.request_id not in failed
                and seq.num_generated < seq.params.max_tokens
                and not seq.solo
            ]
        )
        self.batch.move(step.placement.after, self._seqs)
        self.lookahead.build(self._seqs, started)

    def _record(
        self,
        sampled: step_sampling.Sampled,
        tokens: dict[str, int],
        logprobs: dict[str, TokenLogprob],
        failed: dict[str, str],
    ) -> None:
        """Each request takes its sampled token (its output, penalty history, grammar). A
        request whose grammar failed (its matcher in llguidance's error state: a limit hit)
        ends with `GRAMMAR_FAILED`, its token unshown, and its grammar is compiled afresh for
        the next request; its row stays in the batch this step (the step's forwards are
        built on it) and goes with the core's free."""
        for seq, token in zip(sampled.seqs, sampled.tokens, strict=True):
            seq.output.append(token)
            if seq.history is not None:
                seq.history.append(token)
            if seq.constraint is not None:
                error = advance(seq.constraint, token)
                if error is not None:
                    log.warning("grammar_failed", request_id=seq.request_id, error=error)
                    failed[seq.request_id] = f"{GRAMMAR_FAILED}: {error}"
                    if seq.params.grammar is not None:
                        self.grammars.forget(seq.params.grammar)
                    continue
            tokens[seq.request_id] = token
        if sampled.any_logprobs:
            for seq, lp in zip(sampled.seqs, sampled.logprobs, strict=True):
                if lp is not None and seq.request_id in tokens:
                    logprobs[seq.request_id] = lp

    def look_ahead(self) -> None:
        """Compute the look-ahead the last step built (`LookAhead.start`). The step loop has
        the executor run this right after a step, as the step's result goes back
        (`Executor.call`'s `after`, no round trip through the event loop); without it the
        next step computes it. Never raises: a failure is the next step's."""
        self.lookahead.start()

    def _fail(self, failed: dict[str, str], request_id: str, what: str, exc: BaseException) -> None:
        """End one request's executor state after a fault pinned on it; the step goes on.

        A failed collective (a distributed rank lost) is nobody's request's fault, and
        MLX's next collective after one hangs: it is raised, never retried.
        """
        if is_collective_error(exc):
            raise exc
        log.error("request_failed", request_id=request_id, what=what, error=repr(exc), exc_info=exc)
        failed[request_id] = what
        self._free([request_id])

    def _prefix_report(self) -> PrefixReport | None:
        return self.store.take_report() if self.store is not None else None

    def disk_entries(self) -> list:
        """The disk tier's entries at start, to seed the step loop's index."""
        return self.store.disk_entries() if self.store is not None else []

    def adopt_tokens(self, tokens: Mapping[str, int]) -> int:
        """Make each `tokens[request_id]` that request's last sampled token (a distributed
        rank > 0 takes rank 0's samples, so every rank's cache holds the streamed tokens).
        Returns how many differed from this runner's own samples."""
        changed = 0
        for rid, token in tokens.items():
            seq = self._seqs.get(rid)
            if seq is None or not seq.output or seq.output[-1] == token:
                continue
            # A forward already started with the old token would be wrong (such runners
            # are made with lookahead=False).
            assert self.batch.ahead is None, "adopt_tokens after a look-ahead"
            seq.output[-1] = token
            self.batch.forget_inputs()  # it may be this token's row's
            if seq.history is not None:
                seq.history = RowHistory(seq.prompt.tolist())
                for t in seq.output:
                    seq.history.append(t)
            changed += 1
        return changed

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Add LoRA adapter `name` (an `mlx_lm.lora` directory at `path`) to the model, between
        steps. Raises AdapterError saying why it does not fit the model."""
        return self.adapters.load(name, path)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)
