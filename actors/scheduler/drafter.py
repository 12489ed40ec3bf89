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
given), and copying is what this finds. No second model is involved. Or from a smaller
model with the same tokenizer (`method: "draft_model"`, engine/draft_model.py): the plan
then holds how many drafts a row gets, and the executor makes them.

Who does what:
- the scheduler core keeps a `Drafter` for each request that may speculate (rows with no
  grammar, penalties or logprobs: `speculates`), proposes its drafts each step and
  hears how many were accepted; k follows the acceptance (`Drafter.observe`);
- the policy's step budget (`StepBudget.try_draft`, actors/scheduler/budget.py) fits the
  drafts into the step's token budget and time;
- the executor (`engine/runner.py`, `engine/verify.py`) runs a drafting request against its
  own cache (not the decode batch's: a row's rejected drafts are taken back out of its
  cache alone).

A request decodes in the batch until its suffix occurred before at least `ENTER_MATCH`
tokens long (a copy has begun); the plan then gives it drafts and the executor takes its
row out of the batch (a copy of its cache: tens of ms at batch 8). It drafts on its own
cache while it finds something to copy, and goes back to the batch after `SOLO_PATIENCE`
steps in a row without (its cache merged back in). A chat that copies nothing stays in the
batch, where its step costs what it did without drafts. A request leaves the batch at most
`MAX_ENTRIES` times, and stops drafting for good when its last `WINDOW` drafting steps kept
under `MIN_ACCEPTANCE` of their drafts.

Every cache kind takes rejected drafts back (`engine/rollback.py`): KV layers are trimmed;
a recurrent layer's state (Gated DeltaNet, Mamba2, short convolutions) and a sliding
window's ring that the drafts wrapped are held before the verify and put back after it,
and the tokens kept run through the model again: one more forward, in a step that rejected
a draft. So hybrid and sliding-window models draft as any other, past their window too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stepline.events.models import RequestParams

# A request in the decode batch starts drafting once its last this many tokens (at least
# `prompt_lookup_min`, at most `prompt_lookup_max`) occurred before.
ENTER_MATCH = 4
# A drafting request that found nothing to copy for this many steps in a row goes back to
# the decode batch.
SOLO_PATIENCE = 4
# A request leaves the decode batch to draft at most this many times.
MAX_ENTRIES = 4
# A request whose last `WINDOW` drafting steps accepted under `MIN_ACCEPTANCE` of what they
# proposed stops drafting.
WINDOW = 8
MIN_ACCEPTANCE = 0.2


# A draft the executor makes (a draft model's): the plan holds its place, not its token.
PLACEHOLDER = -1


class SpeculativeConfig(BaseModel):
    """`--speculative-config`, in vLLM's shape: `{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}` or
    `{"method": "draft_model", "model": M, "num_speculative_tokens": k}`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(ge=1, le=32)
    prompt_lookup_min: int = Field(default=2, ge=1, le=64)
    prompt_lookup_max: int = Field(default=5, ge=1, le=64)
    model: str | None = None  # the draft model (`draft_model`): any name `--model` takes

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "a draft model is given as "
                '{"method": "draft_model", "model": NAME, "num_speculative_tokens": K}, and '
                "only there"
            )
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
    if raw.get("method") in ("eagle", "eagle3", "mtp", "medusa"):
        raise ValueError(
            f"speculative method {raw['method']!r} is not supported; use "
            '{"method": "ngram", "num_speculative_tokens": K} (prompt lookup) or '
            '{"method": "draft_model", "model": NAME, "num_speculative_tokens": K}'
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
    occurrence, kept as tokens arrive; whether its row drafts on its own cache (`solo`) or
    decodes in the batch; and its acceptance, which sets how many tokens it drafts (between
    1 and `num_speculative_tokens`) and whether it drafts at all (see the module docstring)."""

    __slots__ = (
        "config",
        "num_tokens",
        "tokens",
        "_index",
        "k",
        "active",
        "solo",
        "_idle",
        "_entries",
        "_recent",
    )

    def __init__(self, config: SpeculativeConfig, prompt: Sequence[int]) -> None:
        self.config = config
        self.num_tokens = 0  # its prompt's and output's
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.k = config.num_speculative_tokens  # drafts it proposes now
        self.active = True  # False: it stopped drafting, for good
        self.solo = False  # its row drafts on its own cache (else: in the decode batch)
        self._idle = 0  # drafting steps in a row it found nothing to copy
        self._entries = 0  # times it left the decode batch
        self._recent: list[tuple[int, int]] = []  # (proposed, accepted) of its last steps
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the request now has (its prompt, then what it generates)."""
        self.num_tokens += len(tokens)
        if self.config.method == "draft_model":
            return  # the executor's draft model reads them
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        mine, index = self.tokens, self._index
        for token in tokens:
            j = len(mine)  # the n-grams ending before position j are followed by `token`
            for n in range(lo, min(hi, j) + 1):
                index[tuple(mine[j - n : j])] = j
            mine.append(token)

    def lookup(self, shortest: int | None = None) -> tuple[int, ...]:
        """Up to k tokens: what followed the latest earlier occurrence of the request's
        longest suffix of at least `shortest` tokens (default `prompt_lookup_min`); () if
        none. With a draft model, k `PLACEHOLDER`s: the executor drafts them."""
        if self.config.method == "draft_model":
            return (PLACEHOLDER,) * self.k
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        if shortest is not None:
            lo = max(lo, min(hi, shortest))
        mine, index = self.tokens, self._index
        for n in range(min(hi, len(mine)), lo - 1, -1):
            at = index.get(tuple(mine[-n:]))
            if at is not None:
                return tuple(mine[at : at + self.k])
        return ()

    def propose(self) -> tuple[int, ...] | None:
        """This step's drafts: a drafting row's lookup (maybe none this step), a batch
        row's only where a copy has begun (`ENTER_MATCH`); None where the row decodes in
        the batch (it stopped, or went back there)."""
        if not self.active:
            return None
        if self.solo:
            return self.lookup() if self._idle < SOLO_PATIENCE else None
        if self._entries >= MAX_ENTRIES:
            return None
        return self.lookup(ENTER_MATCH) or None

    def planned(self, drafts: tuple[int, ...] | None) -> None:
        """Where the step's plan puts its row: drafting on its own cache if the plan gives it
        drafts, or keeps an entry for a row already drafting (`drafts` () : none fit, or
        none found); else in the decode batch. The executor follows the same rule."""
        solo = drafts is not None and (self.solo or bool(drafts))
        if solo and not self.solo:
            self._entries += 1
        if not solo:
            self._idle = 0
        self.solo = solo

    def observe(self, proposed: int, accepted: int) -> None:
        """A drafting step's outcome: `proposed` drafts were verified and `accepted` kept (0
        proposed: it found nothing to copy). k grows by one after a step that kept every
        draft and shrinks to what was kept plus one after one that did not; the request
        stops drafting for good when its last `WINDOW` drafting steps kept under
        `MIN_ACCEPTANCE` of their drafts."""
        if not self.active:
            return
        if proposed == 0:
            self._idle += 1
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
