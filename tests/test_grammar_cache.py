"""The compiled-grammar cache: bounded by bytes, most recently used kept."""

from __future__ import annotations

from stepline.engine.grammar import GrammarCompiler, json_schema_grammar


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
