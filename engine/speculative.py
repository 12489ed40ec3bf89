"""Speculative decoding: drafts from a request's own tokens, verified inside the step.

A decode row may carry drafted tokens: the step's forward computes the row's last token and
its drafts together, the row's own sampling picks the token at each of those places, and the
row keeps the drafts that equal those picks, plus the pick after the last one kept
(`accept`). Every token kept is the one the row would have sampled without drafts: a greedy
row's argmax, and a sampled row's draw, whose randomness is the same function of (seed,
position) as without drafts (engine/sampling.py draws by Gumbel-max with position-keyed
noise), so seeded output is the same token for token, and an unseeded row's tokens are
exact draws from the target model's distribution. On a model whose decode forward is bound
by reading its weights, verifying k drafts costs about as much as one token.

Drafts come from prompt lookup (`method: "ngram"`, vLLM's name): the latest earlier place
in the request's prompt and output where its last n tokens occurred, and the tokens that
followed there. Agents copy (an edited file, a diff, a JSON document whose keys they were
given), and copying is what this finds. No second model is involved.

Who does what:
- the scheduler core keeps a `Drafter` for each request that may speculate (rows with no
  grammar, penalties or logprobs: `speculates`), proposes its drafts each step and
  hears how many were accepted; k follows the acceptance (`Drafter.observe`), and a request
  whose drafts keep being rejected, or that finds nothing to copy, stops drafting for good;
- the policy (`engine/policy.py`) fits the drafts into the step's token budget and time;
- the executor (`engine/runner.py`) runs a drafting request against its own KV cache (not
  the decode batch's: a row's rejected drafts are trimmed from its cache alone), and joins
  it to the batch once it stops drafting.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stepline.events.models import RequestParams

# A request that found nothing to copy for this many steps in a row stops drafting.
PATIENCE_STEPS = 16
# A request whose last `WINDOW` drafting steps accepted under `MIN_ACCEPTANCE` of what they
# proposed stops drafting.
WINDOW = 8
MIN_ACCEPTANCE = 0.2


class SpeculativeConfig(BaseModel):
    """`--speculative-config`, in vLLM's shape: `{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram"]
    num_speculative_tokens: int = Field(ge=1, le=32)
    prompt_lookup_min: int = Field(default=2, ge=1, le=64)
    prompt_lookup_max: int = Field(default=5, ge=1, le=64)

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """`--speculative-config`'s JSON (or its dict) as a config; None for none. Raises
    ValueError with what is wrong, in words (a draft model is not served yet: it says so)."""
    if text is None or text == "":
        return None
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    else:
        raw = text
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    if raw.get("method") in ("draft_model", "eagle", "eagle3", "mtp", "medusa"):
        raise ValueError(
            f"speculative method {raw['method']!r} is not supported; use "
            '{"method": "ngram", "num_speculative_tokens": K} (prompt lookup)'
        )
    try:
        return SpeculativeConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"--speculative-config: {problems}") from None


def speculates(params: RequestParams) -> bool:
    """Whether a request's tokens can be drafted and verified: nothing read per token beside
    the logits and the row's sampling (not a grammar's mask, penalties over the history, or
    logprobs)."""
    return (
        params.grammar is None
        and params.logprobs is None
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1.0
    )


class Drafter:
    """One request's prompt lookup: an index from each n-gram of its tokens
    (`prompt_lookup_min` <= n <= `prompt_lookup_max`) to the position after its latest
    occurrence, kept as tokens arrive; and its acceptance, which sets how many tokens it
    drafts (between 1 and `num_speculative_tokens`) and whether it drafts at all."""

    __slots__ = ("config", "tokens", "_index", "k", "active", "_idle", "_recent")

    def __init__(self, config: SpeculativeConfig, prompt: Sequence[int]) -> None:
        self.config = config
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.k = config.num_speculative_tokens  # drafts it proposes now
        self.active = True  # False: it stopped drafting, for good
        self._idle = 0  # steps in a row it found nothing to copy
        self._recent: list[tuple[int, int]] = []  # (proposed, accepted) of its last steps
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the request now has (its prompt, then what it generates)."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        mine, index = self.tokens, self._index
        for token in tokens:
            j = len(mine)  # the n-grams ending before position j are followed by `token`
            for n in range(lo, min(hi, j) + 1):
                index[tuple(mine[j - n : j])] = j
            mine.append(token)

    def propose(self, most: int | None = None) -> tuple[int, ...]:
        """Up to `min(k, most)` drafted tokens: what followed the latest earlier occurrence of
        the request's longest matching suffix; () if none or it stopped drafting."""
        k = self.k if most is None else min(self.k, most)
        if not self.active or k < 1:
            return ()
        mine, index = self.tokens, self._index
        longest = min(self.config.prompt_lookup_max, len(mine))
        for n in range(longest, self.config.prompt_lookup_min - 1, -1):
            at = index.get(tuple(mine[-n:]))
            if at is not None:
                return tuple(mine[at : at + k])
        return ()

    def observe(self, proposed: int, accepted: int) -> None:
        """A step's outcome: `proposed` drafts were verified and `accepted` kept (0 proposed:
        it found nothing to copy). k grows by one after a step that kept every draft and
        shrinks to what was kept plus one after one that did not; the request stops
        drafting after `PATIENCE_STEPS` steps in a row with nothing to copy, or when its last
        `WINDOW` drafting steps kept under `MIN_ACCEPTANCE` of their drafts."""
        if not self.active:
            return
        if proposed == 0:
            self._idle += 1
            if self._idle >= PATIENCE_STEPS:
                self.active = False
            return
        self._idle = 0
        top = self.config.num_speculative_tokens
        self.k = min(top, self.k + 1) if accepted >= proposed else max(1, accepted + 1)
        recent = self._recent
        recent.append((proposed, accepted))
        if len(recent) > WINDOW:
            del recent[0]
        if len(recent) == WINDOW:
            tried = sum(p for p, _ in recent)
            if sum(a for _, a in recent) < MIN_ACCEPTANCE * tried:
                self.active = False


def accept(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a row keeps: its drafts while each equals the token its sampling picked at
    that place, then the pick after the last one kept (`targets`: the pick at each of the
    row's positions, one more than `drafts`)."""
    kept: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        kept.append(draft)
    kept.append(targets[len(kept)])
    return kept
