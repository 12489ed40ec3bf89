"""The loop guard: an answer that has fallen into repeating itself verbatim ends (reason loop).

A small model at a low temperature may loop one sentence ("It's also one of the most amazing
planets." again and again) until its cap; a repetition penalty cannot stop it, since once a
sentence loops every token of it is penalised already. A `LoopGuard` watches one request's
generated tokens (the scheduler core feeds it each sampled token, beside the stop-token and
length checks: `step_records.cut_at_finish`) and says when they end in a loop:

- a unit of `u` tokens (1 <= u <= MAX_UNIT) repeated back to back, the repeated tail
  (every unit whole, the last one possibly cut) at least MIN_UNITS units long (for a long
  unit: its first time and MAX_TEXT_REPEAT tokens repeated verbatim) and MIN_TOKENS tokens,
  where the unit is text: at least MIN_DISTINCT different tokens, and different tokens for at
  least half of it or at least MIN_DISTINCT_LONG of them (a sentence, a paragraph);
- any other unit (symbols, numbers, markup, itself repetitive: "0, ", "| --- ", "la femme, ",
  a row of a grid), a tail of at least MIN_SHORT_UNITS units (at most its first time and
  MAX_SHORT_REPEAT tokens) and MIN_SHORT_TOKENS tokens.

Why these never cut legitimate output in practice: code, tables, JSON lists and markdown
repeat *structure*, not the same tokens: table rows, list items and lines of code differ in
their cells, values or names. What repeats verbatim in real answers is short or brief: a
separator line, a row of zeros, an empty board or grid, a handful of identical placeholder
lines — units that repeat within themselves ("0, 0, 0", "+---+---+"), which must repeat 16
times and 256 tokens before the guard trips (a 10 x 10 zero matrix, an empty 8 x 8 chess
board in ASCII are below that); a sentence of prose repeated verbatim 4 times in a row (at
least 64 tokens) is a loop, and so is a paragraph of 165 tokens followed by 192 tokens that
repeat it word for word (SmolLM2 at greedy on "Tell me about Jupiter.": two paragraphs,
themselves repeating a sentence, looped to the cap). A
client that asks for exactly its length (`ignore_eos`) gets it: the guard applies by default
to every other request (`--loop-guard`).

Cost: each token is compared only with the earlier occurrences of the same token among the
last MAX_UNIT (a few for prose); a run of one token repeated costs O(MAX_UNIT) a token until
it trips. Pure Python on the ints the core already has: no MLX, no sync.
"""

from __future__ import annotations

from collections import deque

MAX_UNIT = 256  # the longest repeated unit looked for, in tokens
MIN_UNITS = 4  # a text unit repeated this many times ...
MAX_TEXT_REPEAT = 192  # ... (a long one: its first time, then this many tokens again) ...
MIN_TOKENS = 64  # ... over at least this many tokens, is a loop
MIN_DISTINCT = 8  # a text unit: at least this many different tokens, and different tokens
MIN_DISTINCT_SHARE = 0.5  # ... for at least this share of its length
MIN_DISTINCT_LONG = 16  # ... or at least this many (a paragraph that repeats a sentence)
MIN_SHORT_UNITS = 16  # any other unit: this many times ...
MAX_SHORT_REPEAT = 512  # ... (a long one: its first time, then this many tokens again) ...
MIN_SHORT_TOKENS = 256  # ... over at least this many tokens


def text_tail(unit: int) -> int:
    """The repeated tail that makes a loop of a text unit of `unit` tokens."""
    return max(unit + min((MIN_UNITS - 1) * unit, MAX_TEXT_REPEAT), MIN_TOKENS)


def other_tail(unit: int) -> int:
    """The repeated tail that makes a loop of any other unit of `unit` tokens."""
    return max(unit + min((MIN_SHORT_UNITS - 1) * unit, MAX_SHORT_REPEAT), MIN_SHORT_TOKENS)


def is_text(unit: int, distinct: int) -> bool:
    """Whether a unit of `unit` tokens, `distinct` of them different, is text."""
    return distinct >= MIN_DISTINCT and (
        distinct >= MIN_DISTINCT_SHARE * unit or distinct >= MIN_DISTINCT_LONG
    )


class LoopGuard:
    """One request's generated tokens, as far as a loop needs them: `add` each token in
    order; it says whether the tokens now end in a loop (the module's rule)."""

    __slots__ = ("_n", "_recent", "_where", "_run", "_last", "_distinct")

    def __init__(self) -> None:
        self._n = 0  # tokens added
        # the last MAX_UNIT + 1 tokens: a unit of MAX_UNIT is the furthest look back
        self._recent: deque[int] = deque(maxlen=MAX_UNIT + 1)
        # token -> its positions among `_recent`, oldest first
        self._where: dict[int, deque[int]] = {}
        # For each period p (1..MAX_UNIT): how many positions in a row, ending at `_last[p]`,
        # equal the token p before them. A period is only updated where it matches.
        self._run = [0] * (MAX_UNIT + 1)
        self._last = [-2] * (MAX_UNIT + 1)
        # period -> (start of its run, different tokens in its unit), for the run in progress
        self._distinct: dict[int, tuple[int, int]] = {}

    @property
    def num_tokens(self) -> int:
        return self._n

    def add(self, token: int) -> bool:
        """Take the next generated token; True if the tokens now end in a loop."""
        i = self._n
        self._n = i + 1
        recent, where = self._recent, self._where
        if len(recent) == MAX_UNIT + 1:  # the oldest leaves: the oldest position of its token
            old = recent[0]
            seen = where[old]
            seen.popleft()
            if not seen:
                del where[old]
        recent.append(token)
        earlier = where.get(token)
        if earlier is None:
            where[token] = deque((i,))
            return False
        run, last = self._run, self._last
        candidates: list[int] | None = None  # periods whose tail is long enough, shortest first
        for j in reversed(earlier):  # the nearest first: periods from the shortest
            p = i - j
            r = run[p] + 1 if last[p] == i - 1 else 1
            run[p] = r
            last[p] = i
            if r + p >= text_tail(p):  # (any other unit's is longer)
                if candidates is None:
                    candidates = [p]
                else:
                    candidates.append(p)
        earlier.append(i)
        if candidates is None:
            return False
        for p in candidates:
            tail = run[p] + p
            if tail >= other_tail(p) or is_text(p, self._distinct_in_unit(p, i - run[p])):
                return True
        return False

    def _distinct_in_unit(self, p: int, start: int) -> int:
        """Different tokens among the last `p` (the unit of the run of period `p` that
        started at `start`: the same tokens for as long as that run goes on)."""
        known = self._distinct.get(p)
        if known is not None and known[0] == start:
            return known[1]
        recent = self._recent
        n = len(recent)
        count = len({recent[k] for k in range(n - p, n)})
        self._distinct[p] = (start, count)
        return count
