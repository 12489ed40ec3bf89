"""Drafts from a second, smaller model (`--speculative-config '{"method": "draft_model",
"model": M, "num_speculative_tokens": k}'`), on the executor's thread beside the served one.

The plan gives a drafting row a number of drafts (`speculative.PLACEHOLDER`s: the core has
no model to draft with); before the step's forward, the draft model makes them, greedily,
one token at a time against the request's own draft cache. That cache holds the request's
tokens but the newest, as the served model's does: on its first draft it is filled with the
prompt and what was generated so far, and after each step it is cut back past the drafts the
served model rejected (`trim`); what it misses is fed at the next draft (`propose`). Where a
layer cannot be cut back (a recurrent draft model's state, a sliding window's ring its
drafts wrapped: engine/rollback.py), the cache is put back as it was before the step's
drafts, and the next draft feeds the tokens kept since.

The draft model must read the same tokens as the served one (`check_same_tokenizer`), and
keep caches whose tokens can be taken back (`verify.check_speculation`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from stepline.engine.rollback import Held
from stepline.engine.sequences import Seq

if TYPE_CHECKING:
    from stepline.engine.verify import Verify

FEED_CHUNK = 512  # tokens of a draft cache's catch-up per forward (bounds its memory)
PROBE = 'The quick brown fox, 3.14159 — naïve café; <tool_call>{"a": [1, 2]}</tool_call>\n'


@dataclass(eq=False)
class _Drafts:
    """One request's draft cache: how many of its tokens it holds (`fed`), and (while a
    step's drafts are in it) it as it was before them (`held`, holding `fed_before`)."""

    cache: list[Any]
    fed: int = 0
    held: Held | None = field(default=None)
    fed_before: int = 0


class DraftModel:
    """The draft model and its caches, one a drafting request (see the module docstring)."""

    def __init__(self, model: Any, vocab: int | None = None) -> None:
        self.model = model
        self.vocab = vocab  # the served model's: a draft past it ends the row's drafts
        self._caches: dict[str, _Drafts] = {}

    def propose(self, seq: Seq, n: int) -> tuple[int, ...]:
        """Up to `n` greedy drafts after `seq`'s tokens (fewer where one is an id the served
        model does not have)."""
        drafts = self._caches.get(seq.request_id)
        if drafts is None:
            drafts = self._caches[seq.request_id] = _Drafts(make_prompt_cache(self.model))
        cache = drafts.cache
        total = seq.prompt.size + len(seq.output)
        while drafts.fed < total - 1:  # catch up: every token but the newest
            end = min(total - 1, drafts.fed + FEED_CHUNK)
            self.model(self._tokens(seq, drafts.fed, end)[None], cache=cache)
            mx.eval([c.state for c in cache])
            drafts.fed = end
        drafts.held, drafts.fed_before = Held(cache, n), drafts.fed
        token, out = seq.last_token, []
        for _ in range(n):
            logits = self.model(mx.array([[token]], dtype=mx.int32), cache=cache)
            drafts.fed += 1
            token = int(mx.argmax(logits[0, -1]).item())
            if self.vocab is not None and token >= self.vocab:
                break
            out.append(token)
        return tuple(out)

    def fill(self, rows: list[Verify], fail: Callable[[str, Exception], None]) -> list[Verify]:
        """The drafts of the rows the plan holds places for (`rows`); a row whose drafting
        fails is `fail`ed (its request ends) and left out."""
        out = []
        for v in rows:
            if v.drafts:
                try:
                    v.drafts = self.propose(v.seq, len(v.drafts))
                except Exception as exc:
                    fail(v.seq.request_id, exc)
                    continue
            out.append(v)
        return out

    def trim(self, seq: Seq) -> None:
        """After `seq`'s step: its draft cache cut back to hold no token past its newest
        one but one (the drafts the served model rejected go)."""
        drafts = self._caches.get(seq.request_id)
        if drafts is None or drafts.held is None:
            return
        held, drafts.held = drafts.held, None
        over = drafts.fed - (seq.prompt.size + len(seq.output) - 1)
        if over <= 0:
            return
        if held.take_back(over):  # back to before the drafts: the next draft feeds the rest
            drafts.fed = drafts.fed_before
        else:
            drafts.fed -= over

    def forget(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    @staticmethod
    def _tokens(seq: Seq, start: int, end: int) -> mx.array:
        """`seq`'s tokens [start, end) (its prompt, then its output)."""
        n = seq.prompt.size
        parts = []
        if start < n:
            parts.append(seq.prompt[start : min(end, n)])
        if end > n:
            parts.append(mx.array(seq.output[max(0, start - n) : end - n], dtype=mx.int32))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def check_same_tokenizer(served: Any, draft: Any, served_name: str, draft_name: str) -> None:
    """Raise ValueError, in words, unless the two tokenizers give the same ids (a draft is
    read by the served model as its own tokens)."""

    def size(tokenizer: Any) -> int | None:
        vocab = getattr(tokenizer, "vocab", None)
        return len(vocab) if vocab is not None else None

    if served.encode(PROBE) != draft.encode(PROBE) or size(served) != size(draft):
        raise ValueError(
            f"the draft model {draft_name!r} does not share {served_name!r}'s tokenizer "
            f"({size(draft)} tokens against {size(served)}, or another encoding): "
            "a draft model must read the same token ids"
        )
