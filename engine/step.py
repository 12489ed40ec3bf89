"""One step's MLX work, in the order it runs: `prepare` (the runner: which rows decode where,
the look-ahead taken), `Forwards.run` (the model over the step's tokens), `sample` (one
token a row), then the results (the runner: tokens into each request, rows joining, the
next look-ahead).

How a model runs its step's tokens is decided once per model (`forwards_kind`): `Forwards`
runs a forward per prefill chunk, one for the decode batch and one per drafting row;
`FusedForwards` runs whatever it can of them as one (`engine/fused.py`: the architectures and
cache kinds it covers, proven on the loaded model), a chunk with checkpoints inside it too
where the model's snapshots in a fused forward are proven (`SnapshotFusedForwards`). A new
model family or cache kind plugs in there: its own `Forwards`, chosen by `forwards_kind`, and
what its caches can do (`fused.can_fuse`).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import structlog

from stepline.actors.scheduler.plan import ScheduledChunk, StepPlan
from stepline.actors.scheduler.work import CHECKPOINT_FAILED, PREFILL_FAILED, is_collective_error
from stepline.engine import fused, mrope, step_sampling
from stepline.engine.decode_batch import DecodeBatch, Placement
from stepline.engine.forward import body_of, forward, run_to_end, split_head_proof
from stepline.engine.kv_quant import KVQuant
from stepline.engine.lookahead import Ahead
from stepline.engine.lora import Routes
from stepline.engine.models import LoadedModel
from stepline.engine.rollback import Held
from stepline.engine.sampling import Sampler
from stepline.engine.sequences import NO_ROWS, Cache, Rows, Seq
from stepline.engine.step_sampling import Fail, Sampled
from stepline.engine.verify import Verify

log = structlog.get_logger(__name__)


class Checkpoint(Protocol):
    """Snapshot a request's cache at exactly `end` prompt tokens (the runner's checkpoint):
    its cache as it is, or `cache`, its cache at `end` taken inside a fused forward that went
    on past it (`fused.run`'s snapshots)."""

    def __call__(self, seq: Seq, end: int, cache: Cache | None = None) -> None: ...


class CheckpointFailed(Exception):
    """Raised from `Forwards.prefill` when a checkpoint failed (its cause says how)."""


@dataclass
class Step:
    """A step, prepared: where its rows run, and what was built for it ahead."""

    plan: StepPlan
    placement: Placement
    rows: Rows  # the decode batch's rows this step
    ahead: Ahead | None  # the batch's forward, built a step ahead; None: this step runs it
    solo: list[Verify]  # the drafting rows, each with its drafts


@dataclass
class Forwarded:
    """What a step's forwards computed."""

    finals: dict[str, mx.array] = field(default_factory=dict)  # final chunks' last logits
    decoded: mx.array | None = None  # the decode rows' (B, V) logits, where this step ran them
    apart: list[Verify] = field(default_factory=list)  # drafting rows still to run alone


class Forwards:
    """A model's forwards, each on its own: a prefill chunk's, the decode batch's; drafting
    rows run theirs alone in `verify.verify_rows`."""

    fuses = False  # whether it runs a step's tokens in one forward
    fuses_media = False  # whether a chunk with media tokens rides it (`MediaFusedForwards`)
    # whether a chunk with a checkpoint inside rides it (`fused.snapshot_fused_proof`)
    fuses_snapshots = False

    def __init__(
        self,
        loaded: LoadedModel,
        seqs: Mapping[str, Seq],
        batch: DecodeBatch,
        checkpoint: Checkpoint,
        split_head: bool,
        routes: Routes | None = None,
    ) -> None:
        self.model = loaded.model
        self.loaded, self.seqs, self.batch, self.checkpoint = loaded, seqs, batch, checkpoint
        self.split_head = split_head  # the body and the output head run apart
        # which LoRA adapter each row of a forward is, set around each forward (engine/lora.py)
        self.routes = routes or Routes()

    def run(self, step: Step, failed: dict[str, str], fail: Fail) -> Forwarded:
        """The step's forwards (lazy where nothing needs their values yet). A fault in one
        request's chunk or checkpoint ends that request (`fail`); the decode batch's
        raises."""
        out = Forwarded(apart=step.solo)
        self.separately(step, step.plan.chunks, out, failed, fail)
        return out

    def separately(
        self,
        step: Step,
        chunks: Sequence[ScheduledChunk],
        out: Forwarded,
        failed: Mapping[str, str],
        fail: Fail,
    ) -> None:
        """`chunks` a forward each (a fault is that request's), then the decode rows', unless
        built a step ahead or already run."""
        for chunk in chunks:
            if chunk.request_id in failed:
                continue
            try:
                logits = self.prefill(chunk)
            except CheckpointFailed as exc:
                fail(chunk.request_id, CHECKPOINT_FAILED, exc.__cause__ or exc)
                continue
            except Exception as exc:
                fail(chunk.request_id, PREFILL_FAILED, exc)
                continue
            if chunk.is_final:
                assert logits is not None
                out.finals[chunk.request_id] = logits
        if step.ahead is None and out.decoded is None and step.rows:
            out.decoded = self.decode(self.batch.next_inputs())

    def decode(self, inputs: mx.array) -> mx.array:
        """The decode batch's forward on `inputs` (B,), one token per row: (B, V) logits."""
        with self.routes.rows([s.adapter for s in self.batch.rows.seqs]):
            return self.batch.caches.forward(self.model, inputs)

    def prefill(self, chunk: ScheduledChunk) -> mx.array | None:
        """A prompt chunk into its request's cache, split at its checkpoints (each snapshot
        at exactly its offset); a final chunk's last-position logits."""
        seq = self.seqs[chunk.request_id]
        pos = chunk.start
        logits = None
        for end in (*chunk.checkpoints, chunk.end):
            if end == pos:
                continue
            last = end == chunk.end and chunk.is_final
            cache = seq.cache
            if seq.positions is not None:  # 3-D M-RoPE: the chunk's positions are its own
                deepstack = self._deepstack(seq, pos, end)
                cache = mrope.positioned(cache, seq.positions[:, pos:end], deepstack)
            with self.routes.rows([seq.adapter]):
                logits = forward(
                    self.model,
                    seq.prompt[None, pos:end],
                    cache,
                    logits=last,
                    split=self.split_head,
                    embeddings=self._embeddings(seq, pos, end),
                )
            if end in chunk.checkpoints:
                mx.eval([c.state for c in seq.cache])
                try:
                    self.checkpoint(seq, end)
                except Exception as exc:
                    raise CheckpointFailed from exc
            pos = end
        if logits is None:
            mx.eval([c.state for c in seq.cache])  # bound the lazy graph between steps
        for i, image in enumerate(seq.images):  # a span's embeddings, once all in the cache
            if image.end <= chunk.end:
                seq.encodes.pop(i, None)
        return logits

    def _deepstack(self, seq: Seq, start: int, end: int) -> mx.array | None:
        """What the first text layers add at prompt tokens [start, end) (Qwen3-VL's
        deepstack, from the encoder's output), else None."""
        spans = tuple(
            (image.start, image.end, seq.encodes[i].deepstack)
            for i, image in enumerate(seq.images)
            if image.start < end and start < image.end and seq.encodes[i].deepstack is not None
        )
        return self.loaded.vision.encoder.deepstack(end - start, start, spans)

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


class FusedForwards(Forwards):
    """A step's chunks, drafting rows and decode rows in one forward where their caches
    allow (`fused.can_fuse`); the rest each on its own."""

    fuses = True
    _table_dtype: Any = None  # the embedding table's dtype (`_media_fits`), once asked

    def run(self, step: Step, failed: dict[str, str], fail: Fail) -> Forwarded:
        out = Forwarded(apart=step.solo)
        chunks: Sequence[ScheduledChunk] = step.plan.chunks
        # the decode rows too, unless their forward was built a step ahead
        rows = step.rows if step.ahead is None else NO_ROWS
        verifies = [v for v in step.solo if fused.can_fuse(v.seq.cache or [], is_batch=False)]
        together, with_batch = self.fusable(chunks, failed, rows, len(verifies))
        if _num_apart(together, with_batch, len(verifies)) >= 2:
            done = self.run_fused(together, with_batch, failed, fail, verifies)
            if done is not None:
                out.decoded, out.finals = done
                chunks = [c for c in chunks if c not in together]
                out.apart = [v for v in step.solo if v not in verifies]
        self.separately(step, chunks, out, failed, fail)
        return out

    def fusable(
        self,
        chunks: Sequence[ScheduledChunk],
        failed: Mapping[str, str],
        batch: Rows,
        others: int = 0,
    ) -> tuple[list[ScheduledChunk], bool]:
        """The chunks a fused forward can take (caches it handles; a checkpoint inside one
        only where `fuses_snapshots`: otherwise its snapshot needs a forward that stops
        there), and whether the decode rows go with them; ([], False) where it would not
        save a forward: they would run fewer than two apart (`others`: segments it has
        beside them, drafting rows'; a chunk split at its checkpoints is a forward a piece)."""
        together = [
            c
            for c in chunks
            if c.request_id not in failed
            and (self.fuses_snapshots or not _inside(c))
            and (not self._media(c) or (self.fuses_media and self._media_fits(c)))
            and fused.can_fuse(self.seqs[c.request_id].cache or [], is_batch=False)
        ]
        with_batch = bool(batch) and self.batch.caches.can_fuse()
        if _num_apart(together, with_batch, others) < 2:
            return [], False
        return together, with_batch

    def run_fused(
        self,
        chunks: list[ScheduledChunk],
        with_batch: bool,
        failed: dict[str, str],
        fail: Fail,
        verifies: Sequence[Verify] = (),
    ) -> tuple[mx.array | None, dict[str, mx.array]] | None:
        """`chunks`, the drafting rows `verifies` (their logits go in each `Verify`) and, if
        `with_batch`, the decode rows in one forward (`engine/fused.py`), evaluated;
        checkpoints at the chunks' ends are snapshotted after it, those inside a chunk from
        the states the forward captured there (`fused.run`). Returns the decode rows'
        logits (None without rows) and each final chunk's last-position logits.
        None if the forward could not be built: every cache is as it was, and the step runs
        them as separate forwards (where a request's fault is pinned on it). A fault while
        evaluating it is the step's, as the decode batch's is."""
        seqs = [self.seqs[c.request_id] for c in chunks]
        segments = [self._segment(s, c) for s, c in zip(seqs, chunks, strict=True)]
        rows = [[c.num_tokens - 1] if c.is_final else [] for c in chunks]
        for v in verifies:
            segments.append(fused.Segment(v.inputs(), v.seq.cache or []))
            rows.append(list(range(v.num_tokens)))
        groups = self.batch.caches.segments(self.batch.next_inputs()) if with_batch else []
        segments += groups
        rows += [list(range(g.size)) for g in groups]
        # each token's adapter, in the forward's row order: the chunks', the drafting rows',
        # then the decode batch's rows (its groups in order)
        adapters = [
            s.adapter for s, c in zip(seqs, chunks, strict=True) for _ in range(c.num_tokens)
        ]
        adapters += [v.seq.adapter for v in verifies for _ in range(v.num_tokens)]
        adapters += [s.adapter for s in self.batch.rows.seqs] if with_batch else []
        with self.routes.rows(adapters):
            out = self._forward(segments, rows)
        if out is None:
            return None
        for chunk, seq in zip(chunks, seqs, strict=True):  # as `prefill` lets them go
            for i, image in enumerate(seq.images):
                if image.end <= chunk.end:
                    seq.encodes.pop(i, None)
        logits: dict[str, mx.array] = {}
        for chunk, seq, x, taken in zip(chunks, seqs, out.logits, out.snapshots, strict=False):
            try:
                for k in chunk.checkpoints:
                    self.checkpoint(seq, k, taken.get(k - chunk.start))
            except Exception as exc:
                fail(chunk.request_id, CHECKPOINT_FAILED, exc)
                continue
            if x is not None:
                logits[chunk.request_id] = x
        for v, x in zip(verifies, out.logits[len(chunks) :], strict=False):
            v.logits = x
        decoded = [x for x in out.logits[len(chunks) + len(verifies) :] if x is not None]
        if not decoded:
            return None, logits
        return (decoded[0] if len(decoded) == 1 else mx.concatenate(decoded)), logits

    def _media(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` holds media tokens (an image's or a clip's span)."""
        return any(
            i.start < chunk.end and chunk.start < i.end for i in self.seqs[chunk.request_id].images
        )

    def _media_fits(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk`'s media embeddings are in the embedding table's dtype (so its rows
        and the others' run in the dtype their own forwards would) and all computed."""
        seq = self.seqs[chunk.request_id]
        if self._table_dtype is None:
            self._table_dtype = self._embed_dtype()
        for i, image in enumerate(seq.images):
            if image.start < chunk.end and chunk.start < image.end:
                encoded = seq.encodes.get(i)
                embeddings = getattr(encoded, "embeddings", None)
                if embeddings is None or embeddings.dtype != self._table_dtype:
                    return False
        return True

    def _embed_dtype(self) -> Any:
        return body_of(self.model).embed_tokens(mx.array([0])).dtype

    def _segment(self, seq: Seq, chunk: ScheduledChunk) -> fused.Segment:
        """`chunk` of `seq` as a fused forward's segment: its tokens, its checkpoints inside
        it (`fuses_snapshots` only) as snapshots, and, under 3-D M-RoPE, its positions (a
        text chunk's one section, its three sections are one); a chunk with media tokens
        (`fuses_media` only) carries its input embeddings, all three sections and its
        deepstack features, as `prefill` gives them to its own forward."""
        start, end = chunk.start, chunk.end
        tokens, cache = seq.prompt[start:end], seq.cache or []
        snapshots = tuple(k - start for k in _inside(chunk))
        if not self._media(chunk):
            positions = None if seq.positions is None else seq.positions[0, start:end]
            return fused.Segment(tokens, cache, positions=positions, snapshots=snapshots)
        embeddings = self._embeddings(seq, start, end)
        return fused.Segment(
            tokens,
            cache,
            positions=None if seq.positions is None else seq.positions[:, start:end],
            embeddings=None if embeddings is None else embeddings[0],
            deepstack=None if seq.positions is None else self._deepstack(seq, start, end),
            snapshots=snapshots,
        )

    def _forward(self, segments: list[fused.Segment], rows: list[list[int]]) -> fused.Fused | None:
        """`fused.run`, evaluated with the segments' caches and snapshots; None (every cache
        put back as it was, `rollback.Held`: a recurrent layer's state and a window's ring
        included, which the forward wrote over in place) where it could not be built."""
        held = [Held(s.cache, s.size) for s in segments]
        try:
            out = fused.run(self.model, segments, rows)
        except Exception as exc:
            if is_collective_error(exc):
                raise
            log.warning("fused_forward_failed", error=repr(exc), num_segments=len(segments))
            for h in held:
                h.put_back()
            return None
        # let go before evaluating: a ring held would be copied, not written in place
        del held
        mx.eval(
            [x for x in out.logits if x is not None],
            [[c.state for c in s.cache] for s in segments],
            [[c.state for c in cache] for taken in out.snapshots for cache in taken.values()],
        )
        return out


def _num_apart(chunks: Sequence[ScheduledChunk], with_batch: bool, others: int) -> int:
    """How many forwards `chunks`, the decode rows (`with_batch`) and `others` segments
    would run apart: a chunk split at its checkpoints runs a forward a piece."""
    return sum(1 + len(_inside(c)) for c in chunks) + with_batch + others


def _inside(chunk: ScheduledChunk) -> tuple[int, ...]:
    """`chunk`'s checkpoints inside it (not at its end)."""
    return tuple(k for k in chunk.checkpoints if chunk.start < k < chunk.end)


class MediaFusedForwards(FusedForwards):
    """`FusedForwards` where prompt chunks with media tokens (an image's or a clip's span)
    ride the fused forward too, as input embeddings, at their 3-D positions, with their
    deepstack features (`fused.media_fused_proof`, proven on the loaded model)."""

    fuses_media = True


class SnapshotFusedForwards(FusedForwards):
    """`FusedForwards` where a prompt chunk with checkpoints inside it rides the fused
    forward too, its cache snapshotted at each inside it (`fused.snapshot_fused_proof`,
    proven on the loaded model): on a model whose prefixes serve only at their own offset,
    every request's final chunk has one (its last token's, `prefix_cache.exact_only`)."""

    fuses_snapshots = True


class MediaSnapshotFusedForwards(MediaFusedForwards):
    """`MediaFusedForwards` and `SnapshotFusedForwards` both."""

    fuses_snapshots = True


# How a model runs a step's tokens: its forwards, and whether its body and head run apart.
Kind = tuple[type["Forwards"], bool]


def forwards_kind(
    model: Any, *, fuse: bool, kv: KVQuant | None = None, media: bool = False
) -> Kind:
    """The model's forwards, decided once (fused where asked, the architecture is covered
    and a fused forward is proven on this model, over its caches as `kv` quantizes them;
    `media`: a model with a vision or audio tower, whose media chunks ride it too where
    `fused.media_fused_proof` passes), and whether its body and output head run apart
    (`forward.split_head_works`)."""
    return run_to_end(forwards_kind_steps(model, fuse=fuse, kv=kv, media=media))


def forwards_kind_steps(
    model: Any, *, fuse: bool, kv: KVQuant | None = None, media: bool = False
) -> Generator[None, None, Kind]:
    """`forwards_kind`, a few layers of a proof's forward at a time: it yields after each
    (a model loading beside others runs each in a job of its own, `ModelRunner.proofs`)."""
    split_head = yield from split_head_proof(model)
    fuses = fuse and split_head and (yield from fused.fused_forward_proof(model, kv))
    if not fuses:
        return Forwards, split_head
    snapshots = yield from fused.snapshot_fused_proof(model, kv)
    if media and (yield from fused.media_fused_proof(model, kv)):
        return (MediaSnapshotFusedForwards if snapshots else MediaFusedForwards), split_head
    return (SnapshotFusedForwards if snapshots else FusedForwards), split_head


def sample(
    sampler: Sampler,
    finals: list[tuple[Seq, mx.array]],
    step: Step,
    decoded: mx.array | None,
    fail: Fail,
    *,
    pipelined: bool = False,
) -> tuple[Sampled, mx.array | None]:
    """One token for every final chunk (`finals`: each request and its last-position
    logits) and every decode row, finals first; and the decode rows' tokens as an array
    where one batch sampled them all (their next forward's inputs; None where sampled one
    by one). The decode rows' logits are this step's (`decoded`) or the look-ahead's
    (`step.ahead`, whose samples were started with it); `pipelined`: the next forward is
    built on those samples already, and they are read as they are, never redone."""
    if step.ahead is None:
        sampled = step_sampling.sample_step(sampler, finals, step.rows, decoded, fail)
        array = sampled.array
        return sampled, (array[len(finals) :] if array is not None and finals else array)
    first = step_sampling.sample_step(sampler, finals, NO_ROWS, None, fail)
    taken = step_sampling.sample_ahead(sampler, step.ahead, step.rows, fail, redo=not pipelined)
    return first + taken, taken.array
