"""The shape of the decode batch, as the scheduler counts it: mlx-lm's batch cache
(`BatchKVCache`) left-pads every row to the longest of its group, so a row's KV and its
attention are the longest row's, and where steps fuse rows go in decode groups
(`engine/decode_groups.py` keeps them; `place_row` says which one a row joins).
"""

from __future__ import annotations

from collections.abc import Sequence

from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.fold import RequestState

# Where steps fuse (`engine/decode_groups.py`), a row joining the decode batch starts a
# group of its own if joining the group it pads least would add more padded keys than this
# to every step (on SmolLM2 ~12 us of CPU attention a key-row, against a few ms a step for
# one more group's ops)...
SPLIT_KEYS = 1024
# ... and there are fewer groups than this.
MAX_GROUPS = 4


def kv_length(state: RequestState) -> int:
    """Tokens a request's KV may grow to: its prompt plus every token it may generate."""
    return state.num_prompt_tokens + state.params.max_tokens


def decode_context(state: RequestState) -> int:
    """Tokens a decoding request's next token attends to."""
    return state.num_prompt_tokens + state.num_output_tokens


def batch_kv_tokens(lengths: Sequence[int], config: SchedulerConfig) -> int:
    """KV, in tokens, of requests whose KV may grow to `lengths` once they decode together:
    mlx-lm's batch cache (`BatchKVCache`) left-pads every row to the longest, so each row
    takes the longest one's room, plus its fixed per-request state. (Counted per request,
    16 short chats beside one 2,000-token prompt took 11x the KV memory they were counted
    for.)"""
    return len(lengths) * (max(lengths, default=0) + config.kv_tokens_per_seq)


def place_row(groups: Sequence[tuple[int, int]], length: int, split: bool) -> int | None:
    """The decode group a row of `length` keys joins, given each group's (rows, padded
    length): the one it pads least; None for a group of its own (only where `split`)."""
    best, added = None, 0
    for i, (rows, padded) in enumerate(groups):
        more = (rows + 1) * max(padded, length) - rows * padded - length
        if best is None or more < added:
            best, added = i, more
    if best is None or (split and added > SPLIT_KEYS and len(groups) < MAX_GROUPS):
        return None
    return best


def place_rows(
    groups: Sequence[tuple[int, int]], lengths: Sequence[int], split: bool
) -> tuple[list[tuple[int, int]], list[int]]:
    """Rows of `lengths` keys joining decode groups of (rows, padded length), in order, each
    where `place_row` puts it: the groups after, and the group each row went to."""
    after, where = list(groups), []
    for n in lengths:
        i = place_row(after, n, split)
        if i is None:
            i = len(after)
            after.append((0, 0))
        rows, padded = after[i]
        after[i] = (rows + 1, max(padded, n))
        where.append(i)
    return after, where


def padded_decode_context(contexts: Sequence[int], split: bool = False) -> int:
    """The attention work of decode rows with these contexts, in the order they joined the
    batch: mlx-lm's batch cache (`BatchKVCache`) left-pads every row to the longest of its
    group, and attention runs over the padding too; rows go in groups as `place_row` puts
    them (one group unless `split`). (Summed per row, 31 short chats beside one 4,000-token
    request were priced at a tenth of their decode step: stepline-demo-large under Poisson
    arrivals measured 2-3 s decode steps predicted at 0.5 s, and every stream stalled on
    them.)"""
    groups, _ = place_rows([], contexts, split)
    return sum(rows * padded for rows, padded in groups)
