"""The executor's state of one request, and of rows sampled together (the decode batch's, a
step's final chunks): MLX arrays that `engine/runner.py` and `engine/decode_batch.py` own
and change, on the executor's thread only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from stepline.actors.scheduler.spans import PromptImage, adapter_key
from stepline.engine.penalties import RowHistory
from stepline.engine.sampling import RowSampling, SamplingRows
from stepline.events.models import RequestParams

Cache = list[Any]  # one mlx-lm cache object per layer


@dataclass
class Seq:
    """Executor-side state of one request."""

    request_id: str
    prompt: mx.array  # (L,) int32
    sampling: RowSampling
    history: RowHistory | None
    cache: Cache | None  # own cache while prefilling; None once merged into the batch
    # as the scheduler core recorded them (`NewRequest.params`): it ends by length at
    # `max_tokens`, already cut to the context
    params: RequestParams
    output: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    constraint: Any = None  # llguidance matcher of a grammar-constrained request
    images: tuple[PromptImage, ...] = ()  # the prompt's images (a vision model's)
    # image (its index) -> its encoder work (`engine.vision.parts.EncodeJob`), its embeddings
    encodes: dict[int, Any] = field(default_factory=dict)
    # a 3-D M-RoPE model's prompt with images (`engine/mrope.py`): its positions (3, L), and
    # the delta of every position past it (a token's is its index + the delta); None and 0:
    # each token at its index
    positions: mx.array | None = None
    rope_delta: int = 0
    # the prompt as the prefix cache knows it (`spans.prompt_key`); None: its token ids
    key: tuple[int, ...] | None = None
    # the engine's own checkpoint (`NewRequest.own_checkpoint`): not the hook's
    own_checkpoint: int | None = None
    # it drafts (actors/scheduler/drafter.py): it decodes against its own `cache`, not in the batch
    solo: bool = False
    # out of its seat (actors/scheduler/seats.py): its own `cache` kept, it does not decode
    parked: bool = False
    # an embedding request's pooled hidden states so far (`engine.embed.Pool`)
    pool: Any = None
    adapter: str | None = None  # the LoRA adapter it runs with (engine/lora.py); None: the base

    def keyed(self, tokens: Sequence[int]) -> list[int]:
        """Tokens it generated as the prefix cache knows them (its adapter's, `adapter_key`)."""
        return list(adapter_key(tokens, self.adapter))

    def key_of(self, end: int) -> list[int]:
        """The prefix cache's key of the prompt's first `end` tokens."""
        return list(self.key[:end]) if self.key is not None else self.prompt[:end].tolist()

    @property
    def num_generated(self) -> int:
        return len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1]


class Rows:
    """Requests sampled together, in row order (the decode batch; a step's final chunks), and
    what sampling reads from all of them, worked out when the rows are put together: the
    decode batch makes a new `Rows` when requests join or leave, never per step. Immutable;
    each row's position and history are read from its `Seq` when sampling asks."""

    __slots__ = ("seqs", "ids", "index", "sampling", "constrained", "positions", "histories")

    def __init__(self, seqs: Iterable[Seq] = ()) -> None:
        self.seqs = list(seqs)
        self.ids = [s.request_id for s in self.seqs]
        self.index = {rid: i for i, rid in enumerate(self.ids)}  # request id -> row
        self.sampling = SamplingRows(s.sampling for s in self.seqs)
        self.constrained = [i for i, s in enumerate(self.seqs) if s.constraint is not None]
        self.positions: Sequence[int] = _Positions(self.seqs)
        self.histories: Sequence[RowHistory | None] = _Histories(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def __add__(self, other: Rows) -> Rows:
        return Rows(self.seqs + other.seqs)

    def take(self, rows: Iterable[int]) -> Rows:
        return Rows(self.seqs[i] for i in rows)


class _Positions(Sequence[int]):
    """Each row's position: the index of the token it samples next (read when asked)."""

    def __init__(self, seqs: list[Seq]) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i):  # type: ignore[override]
        return len(self._seqs[i].output)


class _Histories(Sequence[RowHistory | None]):
    """Each row's penalty history (read when asked: `adopt_tokens` may replace one)."""

    def __init__(self, seqs: list[Seq]) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i):  # type: ignore[override]
        return self._seqs[i].history


NO_ROWS = Rows()
