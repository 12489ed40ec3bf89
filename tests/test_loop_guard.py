"""The loop guard's rule (actors/scheduler/loop_guard.py), without a model: where it trips on
token sequences, against the rule computed directly, and that answers with repeated
structure (tables, lists, code, grids) written by the demo tokenizer never trip it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer

from stepline.actors.scheduler.loop_guard import (
    MAX_SHORT_REPEAT,
    MAX_TEXT_REPEAT,
    MAX_UNIT,
    MIN_DISTINCT,
    MIN_DISTINCT_LONG,
    MIN_DISTINCT_SHARE,
    MIN_SHORT_TOKENS,
    MIN_SHORT_UNITS,
    MIN_TOKENS,
    MIN_UNITS,
    LoopGuard,
)
from stepline.engine.demo_files import train_tokenizer_json


def first_trip(tokens: list[int]) -> int | None:
    """How many tokens the guard takes before it trips (None: it never does)."""
    guard = LoopGuard()
    for n, token in enumerate(tokens, 1):
        if guard.add(token):
            return n
    return None


def first_loop_by_rule(tokens: list[int]) -> int | None:
    """The same, from the rule as the docs state it: the shortest prefix whose end is a unit
    of u <= MAX_UNIT tokens repeated back to back over T tokens (the longest such tail), with
    T >= MIN_TOKENS and T >= u + min((MIN_UNITS - 1) u, MAX_TEXT_REPEAT) where the unit has
    at least MIN_DISTINCT different tokens, different for MIN_DISTINCT_SHARE of it or at
    least MIN_DISTINCT_LONG; else T >= MIN_SHORT_TOKENS and T >= u + min((MIN_SHORT_UNITS -
    1) u, MAX_SHORT_REPEAT)."""
    s = np.array(tokens)
    n = len(s)
    best: int | None = None
    for u in range(1, min(MAX_UNIT, n - 1) + 1):
        differs = np.flatnonzero(s[u:] != s[:-u]) + u  # positions i with s[i] != s[i - u]
        text_needs = max(u + min((MIN_UNITS - 1) * u, MAX_TEXT_REPEAT), MIN_TOKENS)
        other_needs = max(u + min((MIN_SHORT_UNITS - 1) * u, MAX_SHORT_REPEAT), MIN_SHORT_TOKENS)
        for m in range(u + 1, n + 1):  # the prefix of m tokens
            if best is not None and m >= best:
                break
            before = np.searchsorted(differs, m, side="left")  # differences below m
            last_differs = differs[before - 1] if before else u - 1
            tail = (m - 1 - last_differs) + u
            if tail < text_needs:
                continue
            distinct = len(set(tokens[m - u : m]))
            text = distinct >= MIN_DISTINCT and (
                distinct >= MIN_DISTINCT_SHARE * u or distinct >= MIN_DISTINCT_LONG
            )
            if (text and tail >= text_needs) or tail >= other_needs:
                best = m
                break
    return best


def test_a_sentence_repeated_verbatim_trips_once_the_repeats_reach_64_tokens():
    prose = list(range(100, 130))  # 30 tokens that never repeat
    sentence = list(range(10))  # "It's also one of the most amazing planets." (10 tokens)
    looping = prose + sentence * 20
    assert first_trip(looping) == len(prose) + MIN_TOKENS


def test_a_unit_needs_four_repeats_and_a_long_one_its_first_time_and_192_tokens_again():
    unit = list(range(40))
    assert first_trip(unit * 6) == MIN_UNITS * len(unit)
    paragraph = list(range(165))  # a paragraph that loops, as SmolLM2's about Jupiter did
    assert first_trip(paragraph * 3) == len(paragraph) + MAX_TEXT_REPEAT
    repeating_itself = [1000 + t for t in range(20)] * 2 + [2000 + t for t in range(30)] * 3
    assert first_trip(repeating_itself * 4) == len(repeating_itself) + MAX_TEXT_REPEAT


def test_a_unit_of_few_different_tokens_needs_256_tokens():
    zeros = [7, 8]  # "0", ", "
    assert first_trip(zeros * 200) == MIN_SHORT_TOKENS
    assert first_trip([5] * 300) == MIN_SHORT_TOKENS  # "\n\n\n..."
    row = [1, 2, 3, 2, 3, 2, 3, 4]  # few different tokens, 8 long: 16 units = 128 < 256
    assert first_trip(row * 40) == MIN_SHORT_TOKENS
    grid_row = [1, 2, 3, 2, 3, 2, 3, 4] * 4 + [5, 6, 7]  # 35 tokens, 7 different
    assert first_trip(grid_row * 30) == len(grid_row) + MAX_SHORT_REPEAT


def test_units_longer_than_the_window_are_not_looked_for():
    unit = list(range(MAX_UNIT + 1))
    assert first_trip(unit * 5) is None


@pytest.mark.parametrize("seed", range(6))
def test_the_guard_trips_where_the_rule_says(seed):
    """Random answers with loops of random units (some of few different tokens), drifting
    back to prose between them: the first token where the guard trips is the rule's."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < 700:
        if rng.random() < 0.5:
            tokens += [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        else:
            alphabet = rng.choice([3, 6, 50])
            unit = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
            tokens += (unit * 40)[: rng.randrange(1, 400)]
    assert first_trip(tokens) == first_loop_by_rule(tokens)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(train_tokenizer_json(1024))


def _table() -> str:
    rows = "\n".join(f"| {i} | item {i} | {i * 3.5:.1f} | yes |" for i in range(1, 40))
    return f"| # | name | price | in stock |\n|---|---|---|---|\n{rows}\n"


def _board() -> str:
    line = "+---+---+---+---+---+---+---+---+\n"
    return line + ("|   |   |   |   |   |   |   |   |\n" + line) * 8


LEGITIMATE = {
    "a markdown table": _table(),
    "a JSON list": json.dumps(list(range(300))),
    "a JSON list of records": json.dumps(
        [{"id": i, "name": f"user{i}", "active": i % 2 == 0} for i in range(40)], indent=2
    ),
    "a 10 x 10 zero matrix": "m = [\n"
    + "".join("    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],\n" for _ in range(10))
    + "]\n",
    "a zero vector of 64": "v = [" + ", ".join(["0"] * 64) + "]\n",
    "an empty chess board": _board(),
    "code": "\n".join(
        f"def test_case_{i}(client):\n    response = client.get('/items/{i}')\n"
        f"    assert response.status_code == 200\n"
        for i in range(20)
    ),
    "a bullet list": "".join(f"- Step {i}: open the file and check line {i}.\n" for i in range(40)),
    "a separator and headings": "\n".join(f"{'=' * 60}\nPart {i}\n{'=' * 60}" for i in range(8)),
}


@pytest.mark.parametrize("name", LEGITIMATE)
def test_answers_with_repeated_structure_never_trip(tokenizer, name):
    ids = tokenizer.encode(LEGITIMATE[name]).ids
    assert len(ids) > MIN_TOKENS
    assert first_trip(ids) is None


def test_a_looping_answer_written_by_the_tokenizer_trips_within_a_few_repeats(tokenizer):
    answer = "Jupiter is the largest planet. " + "It's also one of the most amazing planets. " * 30
    ids = tokenizer.encode(answer).ids
    n = first_trip(ids)
    assert n is not None
    shown = tokenizer.decode(ids[:n])
    assert shown.count("amazing planets") <= 6
