"""The compiled-grammar cache: bounded by bytes, most recently used kept."""

from __future__ import annotations

import pytest

from stepline.engine import grammar as grammar_module
from stepline.engine.grammar import GrammarCompiler, GrammarError, json_schema_grammar


def test_the_grammar_cache_is_bounded_by_bytes_and_keeps_the_most_recently_used(demo):
    def schema(i: int) -> str:
        props = {f"p{i}_{k}": {"enum": [f"v{j}" for j in range(10)]} for k in range(40)}
        return json_schema_grammar({"type": "object", "properties": props})

    grammars = [schema(i) for i in range(12)]
    size = GrammarCompiler(demo.tokenizer, 1024).grammar_nbytes
    budget = sum(size(g) for g in grammars[-4:])  # room for the last four
    cache = GrammarCompiler(demo.tokenizer, 1024, max_bytes=budget)
    for g in grammars:
        cache.compile(g)
    assert cache.nbytes <= budget and len(cache) == 4  # the budget, not the count, bounds it
    kept = cache.compile(grammars[-1])
    assert cache.compile(grammars[-1]) is kept  # the newest is a cache hit
    first = cache.compile(grammars[0])  # evicted long ago: compiled again
    assert cache.compile(grammars[0]) is first and len(cache) == 4
    alone = GrammarCompiler(demo.tokenizer, 1024, max_bytes=1)  # smaller than any grammar
    assert alone.compile(grammars[0]) is alone.compile(grammars[0]) and len(alone) == 1


def test_a_held_grammar_outlives_the_cache_and_goes_once_let_go(demo):
    one, two = (json_schema_grammar({"enum": [f"v{i}"]}) for i in range(2))
    cache = GrammarCompiler(demo.tokenizer, 1024, max_entries=1)
    held = cache.hold(one)  # as a request holds its grammar until it ends
    cache.compile(two)  # the cache keeps only this one now
    first = held.matcher
    assert cache.compile(one) is first  # found, not compiled again
    del held
    cache.compile(two)
    assert cache.compile(one) is not first  # nobody held it: compiled again


def test_a_refused_grammar_is_refused_again_without_compiling_it_again(demo, monkeypatch):
    starts: list[int] = []
    check_start = grammar_module._check_start

    def counting(matcher, vocab_size):
        starts.append(vocab_size)
        check_start(matcher, vocab_size)

    monkeypatch.setattr(grammar_module, "_check_start", counting)
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    cache = GrammarCompiler(demo.tokenizer, 1024)
    for _ in range(3):  # refusals are counted in fuel, not time: the same every time
        with pytest.raises(GrammarError, match="no output satisfies it"):
            cache.compile(json_schema_grammar(loop))
    assert len(starts) == 1 and len(cache) == 0
