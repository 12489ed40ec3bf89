"""The prefix index's rules, without MLX: where an entry may be used, what is evicted,
and which requests wait for a prefix another request is computing."""

from __future__ import annotations

from stepline.actors.scheduler.prefix_index import Candidate, EntryInfo, PrefixIndex, plan_prefixes


def info(tokens, nbytes=100, trimmable=True) -> EntryInfo:
    return EntryInfo(tuple(tokens), nbytes, trimmable)


def test_an_exact_entry_serves_its_own_length_and_leaves_one_token_to_compute() -> None:
    index = PrefixIndex(10_000)
    index.add_memory(info(range(10), trimmable=False))
    assert index.best(list(range(12))).num_tokens == 10
    # The whole prompt cached: one token must still be computed, and a recurrent entry
    # cannot be cut back, so there is no usable prefix at all.
    assert index.best(list(range(10))) is None


def test_a_trimmable_entry_serves_any_shorter_common_prefix() -> None:
    index = PrefixIndex(10_000)
    index.add_memory(info(range(50)))
    match = index.best([*range(33), 99, 98])
    assert (match.tokens, match.num_tokens, match.source) == (tuple(range(50)), 33, "memory")


def test_a_recurrent_entry_is_never_used_at_an_offset_it_was_not_taken_at() -> None:
    index = PrefixIndex(10_000)
    index.add_memory(info(range(20), trimmable=False))
    index.add_memory(info(range(50), trimmable=False))
    assert index.best([*range(40), 7, 7]).num_tokens == 20
    assert index.best(list(range(50))).num_tokens == 20
    assert index.best([*range(50), 5]).num_tokens == 50
    assert index.best([5, 6, 7]) is None


def test_the_byte_budget_evicts_the_least_recently_used_entry() -> None:
    index = PrefixIndex(250)
    a, b, c = ([k, *range(1, 10)] for k in (100, 200, 300))
    assert index.add_memory(info(a, trimmable=False)) == []
    assert index.add_memory(info(b, trimmable=False)) == []
    index.touch(tuple(a))
    assert index.add_memory(info(c, trimmable=False)) == [tuple(b)]
    assert index.nbytes == 200 and index.evictions == 1
    assert index.best([*b, 1]) is None and index.best([*a, 1]).num_tokens == 10


def test_an_entry_bigger_than_the_budget_is_not_kept() -> None:
    index = PrefixIndex(50)
    assert index.add_memory(info(range(10), nbytes=51)) == [tuple(range(10))]
    assert index.best(list(range(12))) is None and index.nbytes == 0


def test_a_longer_trimmable_entry_makes_its_trimmable_prefixes_redundant() -> None:
    index = PrefixIndex(10_000)
    index.add_memory(info(range(20)))
    assert index.add_memory(info(range(50))) == [tuple(range(20))]
    assert index.num_memory_entries == 1 and index.nbytes == 100
    assert index.best([*range(20), 9]).num_tokens == 20


def test_a_disk_entry_is_found_by_the_same_rule_and_says_so() -> None:
    index = PrefixIndex(10_000)
    index.add_disk(tuple(range(30)), trimmable=True)
    match = index.best([*range(25), 9])
    assert (match.num_tokens, match.source) == (25, "disk")
    index.add_memory(info(range(30)))  # loaded: now it is in memory
    assert index.best([*range(25), 9]).source == "memory"
    index.remove_disk(tuple(range(30)))
    assert index.best([*range(25), 9]).source == "memory"
    index.remove_memory(tuple(range(30)))
    assert index.best([*range(25), 9]) is None and index.num_entries == 0


def candidate(rid, prompt, *, computed=0, checkpoints=(), waiting=True) -> Candidate:
    return Candidate(rid, tuple(prompt), computed, tuple(checkpoints), waiting)


def test_requests_sharing_a_prefix_being_computed_wait_for_its_checkpoint() -> None:
    system = list(range(1000, 1400))
    index = PrefixIndex(10_000)
    first = candidate("a", [*system, 1, 2], checkpoints=(400, 402))
    others = [
        candidate(r, [*system, k, 3], checkpoints=(400, 402)) for r, k in (("b", 5), ("c", 6))
    ]
    unrelated = candidate("d", [7, 8, 9], checkpoints=(3,))
    plan = plan_prefixes([first, *others, unrelated], index)
    assert plan.deferred == {"b", "c"}  # "a" computes the system prompt once, "d" goes on
    assert plan.cached == {}

    # "a" is past its checkpoint and its snapshot is indexed: the others start from it.
    index.add_memory(info(system, trimmable=False))
    running = candidate("a", first.prompt, computed=402, checkpoints=(400, 402), waiting=False)
    plan = plan_prefixes([running, *others], index)
    assert plan.deferred == frozenset() and plan.cached == {"b": 400, "c": 400}


def test_a_request_does_not_wait_for_a_checkpoint_it_already_has_from_the_cache() -> None:
    system = list(range(100))
    index = PrefixIndex(10_000)
    index.add_memory(info(system[:60], trimmable=False))
    running = candidate("a", [*system, 1], computed=10, checkpoints=(50,), waiting=False)
    plan = plan_prefixes([running, candidate("b", [*system, 2], checkpoints=(100,))], index)
    assert plan.deferred == frozenset() and plan.cached == {"b": 60}


def test_a_disk_only_entry_is_loaded_first_and_the_request_waits_one_step() -> None:
    index = PrefixIndex(10_000)
    index.add_disk(tuple(range(30)), trimmable=False)
    plan = plan_prefixes([candidate("a", [*range(30), 1])], index)
    assert plan.promote == (tuple(range(30)),) and plan.loading == {"a"} and not plan.cached
    # Loaded and lost again (evicted at once): the request stops waiting for the disk.
    again = Candidate("a", (*range(30), 1), 0, (), True, allow_disk=False)
    assert plan_prefixes([again], index).deferred == frozenset()


def test_the_trie_answers_as_a_search_of_every_entry_would() -> None:
    """Random entries (sharing prefixes, some trimmable), added and removed: every lookup
    gives the length the rule gives when each entry is tried in turn."""
    import random

    from stepline.actors.scheduler.prefix_index import IndexEntry, TokenTrie

    def lcp(a, b) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(1)
    trie, live = TokenTrie(), {}
    stems = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12))) for _ in range(6)]
    for _ in range(600):
        stem = rng.choice(stems)
        key = stem[: rng.randrange(1, len(stem) + 1)] + tuple(
            rng.randrange(4) for _ in range(rng.randrange(0, 6))
        )
        if key in live and rng.random() < 0.5:
            trie.remove(key)
            del live[key]
        elif key not in live:
            live[key] = IndexEntry(key, rng.random() < 0.5)
            trie.add(live[key])
        query = rng.choice(stems) + tuple(rng.randrange(4) for _ in range(rng.randrange(0, 8)))
        want = 0
        for entry in live.values():
            common = lcp(entry.tokens, query)
            if common == len(entry.tokens) or entry.trimmable:
                want = max(want, common)
        got = trie.best(query)
        assert (got[0] if got else 0) == want, (query, sorted(live))
        if got:
            n, entry = got
            assert entry.tokens[:n] == query[:n]
            assert n == len(entry.tokens) or entry.trimmable
        extended = any(
            e.trimmable and len(k) > len(key) and k[: len(key)] == key for k, e in live.items()
        )
        assert trie.has_trimmable_extension(key) == extended


def test_the_newest_prefix_of_every_session_stays_and_an_older_turn_goes_first() -> None:
    """Session-aware retention: two agent sessions on a hybrid model (entries only at their
    own offsets) over one system prompt; the budget holds four entries. The older turns of
    the busy session go before the other session's only, older, entry, and the shared
    system prompt (a branch point) stays."""
    index = PrefixIndex(400)
    system = list(range(10))
    a1, b1 = [*system, 100, 101], [*system, 200, 201]
    for tokens in (system, b1, a1):
        assert index.add_memory(info(tokens, trimmable=False)) == []
    a2, a3, a4 = [*a1, 102, 103], [*a1, 102, 103, 104, 105], [*a1, 102, 103, 104, 105, 106]
    assert index.add_memory(info(a2, trimmable=False)) == []
    assert index.add_memory(info(a3, trimmable=False)) == [tuple(a1)]  # not b1, older still
    assert index.add_memory(info(a4, trimmable=False)) == [tuple(a2)]
    assert index.best([*b1, 7]).num_tokens == len(b1)  # the other session's newest stays
    assert index.best([*a4, 7]).num_tokens == len(a4)
    assert index.best([*system, 300, 301]).num_tokens == len(system)  # the shared prefix too
