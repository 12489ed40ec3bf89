"""The MLX work of one step: prefill chunks, one batched decode, sampling.

Runs only on the executor's thread. Each request prefills into its own mlx-lm
prompt cache; when its prompt is done the cache is merged into the decode batch
(`BatchKVCache`, `BatchRotatingKVCache`, `ArraysCache` via mlx-lm's own
`merge`/`extend`/`filter`). Intermediate chunks run the model body only: no
logits. A final chunk computes logits for its last position only. Where the architecture
allows (`engine/fused.py`), a step's chunks and decode rows run as one forward. The batch's
next forward is built as a step ends (unless a prompt is mid-prefill where steps fuse: its
next chunk will carry the rows) and computed while the step loop commits it; a
decode-only step builds it before it reads its tokens, and may start it then too
(`engine/decode_order.py` picks the order that measures faster).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import structlog
from mlx_lm.models.cache import make_prompt_cache

from stepline.actors.scheduler.cost_model import decode_runs_apart
from stepline.actors.scheduler.plan import ScheduledChunk, ScheduledEncode
from stepline.actors.scheduler.spans import prompt_key
from stepline.actors.scheduler.work import (
    ADMISSION_FAILED,
    CHECKPOINT_FAILED,
    ENCODE_FAILED,
    GRAMMAR_FAILED,
    PREFILL_FAILED,
    VERIFY_FAILED,
    Housekeeping,
    NewRequest,
    PrefixReport,
    StepResult,
    StepWork,
    TokenLogprob,
    is_collective_error,
)
from stepline.engine import cpu_attention, fused, step_sampling
from stepline.engine.constraints import advance
from stepline.engine.decode_groups import DecodeCaches
from stepline.engine.decode_order import DecodeOrder
from stepline.engine.draft_model import DraftModel
from stepline.engine.forward import forward, split_head_works
from stepline.engine.grammar import DEFAULT_CACHE_BYTES, GrammarCompiler
from stepline.engine.memory import read_memory_counters
from stepline.engine.models import LoadedModel
from stepline.engine.prefix_cache import PrefixStore, compact_cache, share_cache
from stepline.engine.prefix_files import model_cache_layout, model_fingerprint
from stepline.engine.sampling import PendingSample, RowHistory, RowSampling, Sampler
from stepline.engine.sequences import NO_ROWS, Ahead, Cache, Rows, Seq
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


class _CheckpointFailed(Exception):
    """Raised from `_prefill` when a checkpoint failed (its cause says how)."""


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
    ):
        self.model = loaded.model
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
                model_id=model_fingerprint(loaded.path) if prefix_cache_dir is not None else "",
                layout=model_cache_layout(self.model) if prefix_cache_dir is not None else None,
            )
        self._seqs: dict[str, Seq] = {}
        self._batch = NO_ROWS  # the decode batch's rows, in order
        # Each batch row's last token, the batch's next forward's input, where the array is
        # at hand (the tokens just sampled); None: gathered from the rows' outputs.
        self._inputs: mx.array | None = None
        self._checkpointed: list[Seq] = []  # requests that reached a checkpoint this step
        # The decode batch's next forward, built before its step was planned (see
        # `_build_ahead`). While it is set, every batch row's cache holds its last token.
        self.lookahead = lookahead
        self._ahead: Ahead | None = None
        self._ahead_error: Exception | None = None  # a look-ahead's failed forward
        self._ahead_seconds = 0.0  # the look-ahead's own time: part of the next step's
        # Which order decode-only steps run in (`_pipeline` or not), by measuring both.
        self.decode_order = DecodeOrder()
        # Prompt attention in cache-sized blocks on the CPU (before `fused` wraps it too).
        cpu_attention.install(self.model)
        self._split_head = split_head_works(self.model)
        # Whether a step's chunks and decode rows share one forward (`engine/fused.py`):
        # where the architecture is covered and a fused forward is proven on this model.
        self.fuse = fuse and self._split_head and fused.fused_forward_works(self.model)
        # The decode batch's caches: in groups of similar lengths where steps fuse.
        self._decode = DecodeCaches(split=self.fuse)
        self.grammars = grammars or GrammarCompiler(
            loaded.tokenizer, loaded.vocab_size, max_bytes=grammar_cache_bytes
        )

    # -- request lifecycle ----------------------------------------------------

    def _admit(self, new: NewRequest) -> None:
        p = new.params
        sampling = RowSampling(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logprobs=p.logprobs,
        )
        self._seqs[new.request_id] = Seq(
            request_id=new.request_id,
            prompt=mx.array(new.prompt_token_ids, dtype=mx.int32),
            sampling=sampling,
            history=RowHistory(new.prompt_token_ids) if sampling.needs_history else None,
            cache=self._start_cache(new),
            params=p,
            constraint=self.grammars.matcher(p.grammar) if p.grammar is not None else None,
            images=new.images,
            key=prompt_key(new.prompt_token_ids, new.images) if new.images else None,
        )

    def _start_cache(self, new: NewRequest) -> Cache:
        if new.prefix is None or self.store is None:
            return make_prompt_cache(self.model)
        return self.store.get(new.prefix, new.num_cached_tokens)

    def _retire(self, seq: Seq) -> None:
        """Offer a finished request's cache for reuse: its prompt and the tokens it made, all
        but the last one unless the forward looking ahead has taken that one in too."""
        if self.store is None or seq.num_generated < 1:
            return
        if seq.cache is not None:  # it ended at its first token, never joining the batch
            cache, fed = seq.cache, seq.output[:-1]
        else:
            row = self._batch.index[seq.request_id]
            cache = self._decode.extract(row)
            fed = seq.output if self._ahead is not None else seq.output[:-1]
        tokens = [*seq.key_of(seq.prompt.shape[0]), *fed]
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
        if not gone.isdisjoint(self._batch.index):
            self._keep_rows([i for i, rid in enumerate(self._batch.ids) if rid not in gone])

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only the decode batch's rows `keep` (ascending)."""
        self._batch = self._batch.take(keep)
        self._decode.filter(keep)
        if not keep:
            self._inputs = None
            self._ahead = self._ahead_error = None
            self._ahead_seconds = 0.0
            return
        if self._inputs is not None:
            self._inputs = self._inputs[mx.array(keep)]

    def _join_batch(self, seqs: list[Seq]) -> None:
        """Merge finished prefills into the decode batch."""
        if not seqs:
            return
        assert self._ahead is None, "rows join the batch only after its decode"
        old = self._batch.seqs
        order = self._decode.join(old, seqs)
        at_end = all(a is b for a, b in zip(order, old, strict=False))  # joined after them
        if self._inputs is not None and at_end:
            joined = mx.array([s.last_token for s in order[len(old) :]], dtype=mx.int32)
            self._inputs = mx.concatenate([self._inputs, joined])
        else:  # gathered from the rows' last tokens when next needed
            self._inputs = None
        self._batch = Rows(order)

    # -- one step -------------------------------------------------------------

    def _prefill(self, chunk: ScheduledChunk) -> mx.array | None:
        seq = self._seqs[chunk.request_id]
        pos = chunk.start
        logits = None
        # Split at checkpoints so the cache can be snapshotted at exactly each offset.
        for end in (*chunk.checkpoints, chunk.end):
            if end == pos:
                continue
            last = end == chunk.end and chunk.is_final
            logits = forward(
                self.model,
                seq.prompt[None, pos:end],
                seq.cache,
                logits=last,
                split=self._split_head,
                embeddings=self._embeddings(seq, pos, end),
            )
            if end in chunk.checkpoints:
                mx.eval([c.state for c in seq.cache])
                try:
                    self._checkpoint(seq, end)
                except Exception as exc:
                    raise _CheckpointFailed from exc
            pos = end
        if logits is None:
            mx.eval([c.state for c in seq.cache])  # bound the lazy graph between steps
        for i, image in enumerate(seq.images):  # a span's embeddings, once all in the cache
            if image.end <= chunk.end:
                seq.encodes.pop(i, None)
        return logits

    def _embeddings(self, seq: Seq, start: int, end: int) -> mx.array | None:
        """Input embeddings of prompt tokens [start, end) where image spans overlap them
        (their encoder's output, computed in earlier units), else None: the embedding
        table's."""
        spans = tuple(
            (image.start, image.end, seq.encodes[i].embeddings)
            for i, image in enumerate(seq.images)
            if image.start < end and start < image.end
        )
        if not spans:
            return None
        return self.loaded.vision.encoder.embeddings(seq.prompt[start:end], start, spans)

    def _encode(self, work: ScheduledEncode) -> None:
        """Units of the encoder's work for one image of a request's prompt."""
        from stepline.engine.vision import EncodeJob

        seq = self._seqs[work.request_id]
        job = seq.encodes.get(work.image)
        if job is None:
            image = seq.images[work.image]
            span = seq.prompt[image.start : image.end]
            job = seq.encodes[work.image] = EncodeJob(span, image.inputs, image.units)
        self.loaded.vision.encoder.run(job, work.start, work.end)

    def _fusable(
        self,
        chunks: Sequence[ScheduledChunk],
        failed: Mapping[str, str],
        batch: Rows,
        others: int = 0,
    ) -> tuple[list[ScheduledChunk], bool]:
        """The chunks a fused forward can take (plain KV caches, no checkpoint inside: a
        snapshot inside a chunk needs a forward that stops there), and whether the decode
        rows go with them; ([], False) where fewer than two segments would share it
        (`others`: segments it has beside them, drafting rows')."""
        together = [
            c
            for c in chunks
            if c.request_id not in failed
            and not any(c.start < k < c.end for k in c.checkpoints)
            and not any(
                i.start < c.end and c.start < i.end for i in self._seqs[c.request_id].images
            )
            and fused.can_fuse(self._seqs[c.request_id].cache or [], is_batch=False)
        ]
        with_batch = bool(batch) and self._decode.can_fuse()
        if len(together) + with_batch + others < 2:
            return [], False
        return together, with_batch

    def _fused_step(
        self,
        chunks: list[ScheduledChunk],
        batch: Rows,
        failed: dict[str, str],
        verifies: Sequence[Verify] = (),
    ) -> tuple[mx.array | None, dict[str, mx.array]] | None:
        """`chunks`, the drafting rows `verifies` (their logits go in each `Verify`) and the
        decode rows of `batch` in one forward (`engine/fused.py`), evaluated; checkpoints at
        the chunks' ends are snapshotted after it. Returns the decode rows' logits (None
        without rows) and each final chunk's last-position logits.
        None if the forward could not be built: every cache is as it was, and the step runs
        them as separate forwards (where a request's fault is pinned on it). A fault while
        evaluating it is the step's, as the decode batch's is."""
        seqs = [self._seqs[c.request_id] for c in chunks]
        segments = [
            fused.Segment(s.prompt[c.start : c.end], s.cache or [])
            for s, c in zip(seqs, chunks, strict=True)
        ]
        rows = [[c.num_tokens - 1] if c.is_final else [] for c in chunks]
        for v in verifies:
            segments.append(fused.Segment(v.inputs(), v.seq.cache or []))
            rows.append(list(range(v.num_tokens)))
        groups = self._decode.segments(self._next_inputs()) if batch else []
        segments += groups
        rows += [list(range(g.size)) for g in groups]
        saved = [[layer.state for layer in s.cache] for s in segments]
        try:
            out = fused.forward(self.model, segments, rows)
        except Exception as exc:
            if is_collective_error(exc):
                raise
            log.warning("fused_forward_failed", error=repr(exc), num_segments=len(segments))
            for s, states in zip(segments, saved, strict=True):
                for layer, state in zip(s.cache, states, strict=True):
                    layer.state = state
            return None
        mx.eval([x for x in out if x is not None], [[c.state for c in s.cache] for s in segments])
        logits: dict[str, mx.array] = {}
        for chunk, seq, x in zip(chunks, seqs, out, strict=False):
            if chunk.end in chunk.checkpoints:
                try:
                    self._checkpoint(seq, chunk.end)
                except Exception as exc:
                    self._fail(failed, chunk.request_id, CHECKPOINT_FAILED, exc)
                    continue
            if x is not None:
                logits[chunk.request_id] = x
        for v, x in zip(verifies, out[len(chunks) :], strict=False):
            v.logits = x
        decoded = [x for x in out[len(chunks) + len(verifies) :] if x is not None]
        if not decoded:
            return None, logits
        return (decoded[0] if len(decoded) == 1 else mx.concatenate(decoded)), logits

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

    def _checkpoint(self, seq: Seq, end: int) -> None:
        """Snapshot `seq`'s cache at `end` prompt tokens: the prefix cache, then the hook."""
        if not seq.checkpoints:
            self._checkpointed.append(seq)
        seq.checkpoints.append(end)
        snapshot = snapshot_cache(seq.cache)
        if self.store is not None:
            self.store.put(seq.key_of(end), snapshot)
        if self.on_checkpoint is not None:
            self.on_checkpoint(seq.request_id, end, share_cache(snapshot))

    def run(self, work: StepWork) -> StepResult:
        """Run one step. A fault pinned on one request (its set-up, its prefill chunk, its
        checkpoint, its sampling row) drops that request and is reported in
        `StepResult.failed`; the rest of the step goes on. Any other fault (the batched
        decode forward, evaluating a fused forward, the plan disagreeing with the batch)
        raises."""
        # The step's time includes the look-ahead that started its decode.
        t0, self._ahead_seconds = time.perf_counter() - self._ahead_seconds, 0.0
        self._housekeep(work)
        if self._ahead_error is not None:  # the batch's look-ahead forward failed
            error, self._ahead_error = self._ahead_error, None
            raise error
        failed: dict[str, str] = {}
        for new in work.admit:
            try:
                self._admit(new)
            except Exception as exc:
                self._fail(failed, new.request_id, ADMISSION_FAILED, exc)
        plan = work.plan
        for encode in plan.encodes:
            if encode.request_id in failed:
                continue
            try:
                self._encode(encode)
            except Exception as exc:
                self._fail(failed, encode.request_id, ENCODE_FAILED, exc)
        # Rows that draft this step: those given drafts, and those already drafting that
        # the plan keeps drafting (none found this step); the core follows the same rule
        # (`Drafter.planned`).
        drafting = {
            rid: d
            for rid, d in plan.drafts.items()
            if rid in self._seqs and (d or self._seqs[rid].solo)
        }
        # A drafting row that stops joins the batch, and a batch row that starts drafting
        # leaves it; where the batch's forward for this step was built a step ahead, each
        # moves after this step (it decodes this step where it was).
        leaving = (
            [
                rid
                for rid in plan.decodes
                if rid not in drafting and rid in self._seqs and self._seqs[rid].solo
            ]
            if self._seqs.keys() != self._batch.index.keys()  # (only then is a row solo)
            else []
        )
        entering = [rid for rid in drafting if not self._seqs[rid].solo]
        if self._ahead is not None:
            for rid in entering:
                del drafting[rid]
            drafting.update((rid, ()) for rid in leaving)
        else:
            self._stop_drafting(leaving)
            self._leave_batch(entering)
            leaving, entering = [], []
        batch = self._batch
        if batch.index.keys() != {rid for rid in plan.decodes if rid not in drafting}:
            raise RuntimeError(
                f"plan decodes {sorted(plan.decodes)} (drafting: {sorted(drafting)}) but the "
                f"batch holds {sorted(batch.ids)}"
            )
        solo = [Verify(self._seqs[rid], d) for rid, d in drafting.items() if rid not in failed]
        if self.draft is not None:
            solo = self.draft.fill(
                solo, lambda rid, exc: self._fail(failed, rid, VERIFY_FAILED, exc)
            )

        for seq in self._checkpointed:
            seq.checkpoints.clear()
        self._checkpointed = []
        ahead, self._ahead = self._ahead, None
        last_logits: dict[str, mx.array] = {}  # final chunks' last-position logits
        decoded: mx.array | None = None  # the decode rows' logits, if a fused forward ran them
        separate = list(plan.chunks)
        apart = solo  # drafting rows not in the fused forward
        if self.fuse:  # the decode rows too, unless their forward was built a step ahead
            rows = batch if ahead is None else NO_ROWS
            verifies = [v for v in solo if fused.can_fuse(v.seq.cache or [], is_batch=False)]
            together, with_batch = self._fusable(plan.chunks, failed, rows, len(verifies))
            if len(together) + with_batch + len(verifies) >= 2:
                done = self._fused_step(
                    together, batch if with_batch else NO_ROWS, failed, verifies
                )
                if done is not None:
                    decoded, fused_logits = done
                    last_logits.update(fused_logits)
                    separate = [c for c in plan.chunks if c not in together]
                    apart = [v for v in solo if v not in verifies]
        for chunk in separate:
            if chunk.request_id in failed:
                continue
            try:
                logits = self._prefill(chunk)
            except _CheckpointFailed as exc:
                self._fail(failed, chunk.request_id, CHECKPOINT_FAILED, exc.__cause__ or exc)
                continue
            except Exception as exc:
                self._fail(failed, chunk.request_id, PREFILL_FAILED, exc)
                continue
            if chunk.is_final:
                assert logits is not None
                last_logits[chunk.request_id] = logits
        tokens: dict[str, int] = {}

        def fail(request_id: str, what: str, exc: BaseException) -> None:
            self._fail(failed, request_id, what, exc)

        drafted = verify_rows(self.model, self.sampler, solo, apart, tokens, failed, fail)
        if self.draft is not None:
            for v in solo:
                self.draft.trim(v.seq)
        # final chunks, in the plan's order: (request, last-position logits)
        finals = [
            (self._seqs[c.request_id], last_logits[c.request_id])
            for c in plan.chunks
            if c.request_id in last_logits and c.request_id not in failed
        ]
        logprobs: dict[str, TokenLogprob] = {}

        sample = step_sampling.sample_step
        started: mx.array | None = None  # the next step's forward, if already built
        pending = ahead.sample if ahead is not None else None
        if (
            batch
            and not plan.chunks
            and pending is not None
            and pending.tokens_final
            and not entering  # (the forward it builds would hold the entering rows and
            and not leaving  # not the leaving ones)
        ):
            # Decode rows only, their tokens read by evaluating them: the next forward is
            # built on them before they are read (`_pipeline`).
            start_now = self.decode_order.start(len(batch), time.perf_counter())
            started, taken = self._pipeline(pending, ahead, batch, start_now=start_now)
            self._record(taken, tokens, logprobs, failed)
            self._took(batch, taken.array)
        else:
            self.decode_order.interrupt()
            if ahead is None:
                if decoded is None and batch:
                    decoded = self._decode_forward(self._next_inputs())
                sampled = sample(self.sampler, finals, batch, decoded, fail)
                self._record(sampled, tokens, logprobs, failed)
                if batch:  # the batch's rows come after the finals'
                    array = sampled.array
                    self._took(
                        batch, array[len(finals) :] if array is not None and finals else array
                    )
            else:
                self._record(
                    sample(self.sampler, finals, NO_ROWS, None, fail), tokens, logprobs, failed
                )
                taken = step_sampling.sample_ahead(self.sampler, ahead, batch, fail)
                self._record(taken, tokens, logprobs, failed)
                self._took(batch, taken.array)
        self._join_finals(finals, failed)
        self._stop_drafting(leaving)
        self._leave_batch([rid for rid in entering if rid in self._seqs])
        self._build_ahead(started)
        return StepResult(
            tokens=tokens,
            drafted=drafted,
            logprobs=logprobs,
            checkpoints={
                s.request_id: tuple(s.checkpoints)
                for s in self._checkpointed
                if s.checkpoints and self._seqs.get(s.request_id) is s
            },
            seconds=time.perf_counter() - t0,
            prefix=self._prefix_report(),
            failed=failed,
            memory=read_memory_counters(),
        )

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

    def _took(self, batch: Rows, array: mx.array | None) -> None:
        """The decode rows `batch` took their tokens, `array` (None where sampled one by
        one): the next forward's inputs, if the batch is still those rows."""
        kept = array is not None and self._batch is batch
        self._inputs = array.astype(mx.int32) if kept else None

    def _join_finals(self, finals: list[tuple[Seq, mx.array]], failed: dict[str, str]) -> None:
        # A request that ended at its first token (max_tokens=1: asked for, or all the room
        # its prompt left in the context) never joins: merging its cache would pad every row
        # to its length. A drafting one decodes on its own cache until it stops drafting.
        self._join_batch(
            [
                seq
                for seq, _ in finals
                if seq.request_id not in failed
                and seq.num_generated < seq.params.max_tokens
                and not seq.solo
            ]
        )

    def _leave_batch(self, request_ids: Sequence[str]) -> None:
        """Batch rows that start drafting: each takes its own copy of its cache out of the
        batch (mlx-lm's `extract`), and decodes on it."""
        index = self._batch.index
        rows = sorted(index[rid] for rid in request_ids if rid in index)
        if not rows:
            return
        assert self._ahead is None, "rows leave the batch only after its decode"
        for row in rows:
            seq = self._batch.seqs[row]
            seq.cache, seq.solo = self._decode.extract(row), True
        gone = set(rows)
        self._keep_rows([i for i in range(len(self._batch)) if i not in gone])

    def _stop_drafting(self, request_ids: Sequence[str]) -> None:
        """Drafting requests the plan decodes in the batch: they stopped drafting (found
        nothing to copy for a while, or for good), and join the decode batch (before the
        step's forward, or after it where the batch's was built a step ahead)."""
        seqs = [self._seqs[rid] for rid in request_ids if rid in self._seqs]
        leaving = [s for s in seqs if s.solo and s.output and s.cache is not None]
        for seq in leaving:
            seq.solo = False
        self._join_batch(leaving)

    def _next_inputs(self) -> mx.array:
        """Each batch row's last token: the batch's next forward's inputs (B,)."""
        if self._inputs is None:
            self._inputs = mx.array([s.last_token for s in self._batch.seqs], dtype=mx.int32)
        return self._inputs

    def _decode_forward(self, inputs: mx.array) -> mx.array:
        """The decode batch's forward on `inputs` (B,), one token per row: (B, V) logits."""
        return self._decode.forward(self.model, inputs)

    def _pipeline(
        self, pending: PendingSample, ahead: Ahead, batch: Rows, *, start_now: bool
    ) -> tuple[mx.array | None, step_sampling.Sampled]:
        """A step with nothing but decode rows, run as mlx-lm's own loop runs one: the next
        step's forward is built on this step's tokens while they are still being computed,
        then they are read. Building a graph is the host's Python; it overlaps the last of
        the tokens' computation instead of following it.

        With `start_now` (where `decode_order` finds it faster) the forward is also started
        before the tokens are read: MLX then queues it right behind them, with no gap on the
        device while the host reads the tokens (on Metal the step loop's whole round trip is
        hidden behind it, too). Otherwise `look_ahead` starts it as the step's result goes
        back: on Linux's CPU backend starting work returns only once it is nearly done, and
        starting it here would hold the result back that long.

        A row that ends at this step's token (a stop, a cancel, its length) still has the
        next one computed, never shown: the one token in flight, as with `_build_ahead`.
        Only where reading the tokens is just evaluating them (`tokens_final`): a failure to
        read them is then MLX's on the whole batch, and raises (the next forward depends on
        them), where `sample_ahead` would sample each row again. Returns the built forward
        (None if it could not be built: the next step's fault) and this step's tokens."""
        rows = ahead.rows_of(batch)
        unread = pending.tokens if rows is None else pending.tokens[mx.array(rows)]
        started: mx.array | None = None
        try:
            started = self._decode_forward(unread)
            if start_now:
                mx.async_eval(started)
        except Exception as exc:  # noqa: BLE001 - the batched decode's fault: see run
            self._ahead_error, started = exc, None
        out = pending.finish()
        taken = out.tokens if rows is None else [out.tokens[i] for i in rows]
        return started, step_sampling.Sampled(batch.seqs, taken, [None] * len(batch), False, unread)

    def _build_ahead(self, started: mx.array | None = None) -> None:
        """Build (lazily) the next step's decode forward and its sampling, as mlx-lm's own
        loop does; `look_ahead` starts computing them, and the next step takes their tokens.
        Every row's next input is known (the token just sampled), and so is what its sampling
        reads (its position, penalty history and grammar state). A row that ends meanwhile (a
        stop, a cancel) is skipped, so its token is never shown. The next step's prefill
        chunks run after it; their requests join the batch after it. A forward that cannot
        be built is the next step's fault (this step's tokens stand). `started`: the forward,
        already built (and maybe started) by `_pipeline`; only its sampling is built here."""
        batch = self._batch
        if not self.lookahead or not batch or self._ahead_error is not None:
            return
        # Requests outside the batch are prefilling, drafting (their rows run in the next
        # step's fused forward, as a chunk does), or ended at their first token.
        prefilling = len(self._seqs) > len(batch) and any(
            s.cache is not None and (s.solo or not s.output) for s in self._seqs.values()
        )
        if started is None and not decode_runs_apart(fused_steps=self.fuse, prefilling=prefilling):
            return  # a prompt is mid-prefill: the next step runs these rows in its chunk's forward
        # (A forward already built has written the rows' caches: it is kept, whatever comes.)
        logits = started
        if logits is None:
            try:
                logits = self._decode_forward(self._next_inputs())
            except Exception as exc:  # noqa: BLE001 - the batched decode's fault: see run
                self._ahead_error = exc
                return
        try:
            sample: PendingSample | None = step_sampling.start_rows(self.sampler, logits, batch)
        except Exception as exc:  # noqa: BLE001 - the step samples again, and isolates it
            log.info("look_ahead_sampling_deferred", error=repr(exc))
            sample = None
        self._ahead = Ahead(batch, logits, sample)

    def look_ahead(self) -> None:
        """Compute the look-ahead the last step built (after a decode-only step that started
        it, `_pipeline`, its forward is already running: this starts its sampling). The step
        loop has the executor run this right after a step, as the step's result goes back
        (`Executor.call`'s `after`, no round trip through the event loop): MLX computes
        without the GIL (on Linux's CPU backend `async_eval` returns only once the forward is
        nearly done) while the step loop commits that step and plans the next. Without it
        the next step computes it. Never raises: a failure is the next step's."""
        ahead = self._ahead
        if ahead is None:
            return
        t0 = time.perf_counter()
        try:
            mx.async_eval(ahead.logits, *(ahead.sample.arrays() if ahead.sample else ()))
        except Exception as exc:  # noqa: BLE001 - the next step reads it again
            log.info("look_ahead_failed", error=repr(exc))
        self._ahead_seconds = time.perf_counter() - t0

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
            assert self._ahead is None, "adopt_tokens after a look-ahead"
            seq.output[-1] = token
            self._inputs = None  # it may be this token's row's
            if seq.history is not None:
                seq.history = RowHistory(seq.prompt.tolist())
                for t in seq.output:
                    seq.history.append(t)
            changed += 1
        return changed

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)
