"""The prefix index: which cached prefix a prompt may start from. MLX-free.

The step loop owns it and consults it when it schedules a request's first chunk; the
executor only stores the arrays (`prefix_cache.PrefixStore`) and reports what it added
or lost. One token trie holds every entry, in memory, on disk or both, and one rule
says where an entry may be used:

- an entry holding exactly the first k tokens of the prompt is usable at k, for every
  cache kind (its state is the state after exactly those k tokens);
- an entry sharing only its first m < k tokens with the prompt is usable at m only if
  every layer can be cut back (`trimmable`: attention caches, sliding windows that
  have not wrapped). Recurrent state (`ArraysCache`) exists only at the offset it was
  taken at: such an entry is never used anywhere else;
- at least one prompt token is always left to compute (the first output token needs
  its logits).

The memory tier has a byte budget; the index decides what is evicted and the step loop tells
the store. Eviction is session-aware, not plain LRU over entries: an agent's session leaves a
chain of entries, each turn's a prefix of the next, and only the newest serves its next turn.
So an entry that a longer one extends along a single path (an older turn of one session) goes
first, least recently used first; then the rest, least recently used first: the newest prefix
of every session, and a prefix that sessions share (a branch point: a system prompt), stay
longest. The disk tier's budget is the store's (it
owns the files); the index only mirrors which entries are on disk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from stepline.events.models import PrefixMiss

Tokens = tuple[int, ...]

# The keys of this many entries evicted last are kept, to tell a miss that an eviction
# caused (`PrefixIndex.explain`); their tokens only, no state.
EVICTED_KEYS = 64


@dataclass
class IndexEntry:
    tokens: Tokens
    trimmable: bool  # usable at any shorter common prefix, not only at its own length
    nbytes: int = 0  # memory tier bytes, 0 when not in memory
    in_memory: bool = False
    on_disk: bool = False


@dataclass(frozen=True)
class EntryInfo:
    """An entry the executor's store now holds in memory (or on disk)."""

    tokens: Tokens
    nbytes: int
    trimmable: bool


@dataclass(frozen=True)
class Match:
    tokens: Tokens  # the entry's key
    num_tokens: int  # prompt tokens it serves (<= len(tokens))
    source: Literal["memory", "disk"]


class _Node:
    """A radix-trie node: the tokens on the edge from its parent, its children by their
    edge's first token, the entry ending exactly here, and how many trimmable entries end
    here or below. One node per branch point, not per token: an index of long prompts
    costs about what their token tuples cost."""

    __slots__ = ("edge", "children", "entry", "num_trimmable")

    def __init__(self, edge: Tokens = ()) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.entry: Any = None
        self.num_trimmable = 0


class TokenTrie:
    """Entries keyed by their tokens (anything with `tokens` and `trimmable`); answers 'the
    longest usable prefix' in one walk. A radix trie: edges hold runs of tokens."""

    def __init__(self) -> None:
        self.root = _Node()

    def _descend(self, tokens: Sequence[int]) -> tuple[list[_Node], int, _Node | None, int]:
        """Follow `tokens` from the root: (nodes whose whole edge matched, root first; the
        tokens they cover; the node whose edge matched only partly, or None; how many of
        its edge's tokens matched)."""
        nodes = [self.root]
        depth = 0
        while depth < len(tokens):
            child = nodes[-1].children.get(tokens[depth])
            if child is None:
                return nodes, depth, None, 0
            edge = child.edge
            n = 0
            limit = min(len(edge), len(tokens) - depth)
            while n < limit and edge[n] == tokens[depth + n]:
                n += 1
            if n < len(edge):
                return nodes, depth, child, n
            nodes.append(child)
            depth += n
        return nodes, depth, None, 0

    def add(self, entry: Any) -> None:
        tokens = tuple(entry.tokens)
        nodes, depth, partial, matched = self._descend(tokens)
        parent = nodes[-1]
        if partial is not None:  # split its edge where the new key leaves it
            middle = _Node(partial.edge[:matched])
            middle.num_trimmable = partial.num_trimmable
            partial.edge = partial.edge[matched:]
            middle.children[partial.edge[0]] = partial
            parent.children[middle.edge[0]] = middle
            nodes.append(middle)
            depth += matched
        if depth < len(tokens):
            leaf = _Node(tokens[depth:])
            nodes[-1].children[leaf.edge[0]] = leaf
            nodes.append(leaf)
        assert nodes[-1].entry is None, "remove the old entry first"
        nodes[-1].entry = entry
        if entry.trimmable:
            for node in nodes:
                node.num_trimmable += 1

    def remove(self, tokens: Tokens) -> None:
        nodes, depth, partial, _ = self._descend(tokens)
        node = nodes[-1]
        if partial is not None or depth != len(tokens) or node.entry is None:
            return
        if node.entry.trimmable:
            for n in nodes:
                n.num_trimmable -= 1
        node.entry = None
        # Prune: drop an empty leaf; fold a node left with one child and no entry into it.
        for i in range(len(nodes) - 1, 0, -1):
            node, parent = nodes[i], nodes[i - 1]
            if node.entry is not None:
                break
            if not node.children:
                del parent.children[node.edge[0]]
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                parent.children[child.edge[0]] = child
            break

    def shared(self, tokens: Sequence[int]) -> int:
        """How many first tokens of `tokens` some entry's key starts with (the deepest
        point of the trie that `tokens` reaches)."""
        _, depth, partial, matched = self._descend(tokens)
        return depth + matched if partial is not None else depth

    def num_branches(self, tokens: Sequence[int]) -> int:
        """How many ways longer entries go on from entry `tokens` (0: none extends it; 2 or
        more: prompts part there); 0 for tokens that are no entry."""
        nodes, depth, partial, _ = self._descend(tokens)
        if partial is not None or depth != len(tokens) or nodes[-1].entry is None:
            return 0
        return len(nodes[-1].children)

    def has_trimmable_extension(self, tokens: Sequence[int]) -> bool:
        """Whether a trimmable entry holds `tokens` and more (so it can serve `tokens`)."""
        nodes, depth, partial, matched = self._descend(tokens)
        if partial is not None:  # `tokens` ends inside its edge: all below extend it
            return matched + depth == len(tokens) and partial.num_trimmable > 0
        if depth != len(tokens):
            return False
        node = nodes[-1]
        own = 1 if node.entry is not None and node.entry.trimmable else 0
        return node.num_trimmable - own > 0

    def trimmable_prefixes(self, tokens: Sequence[int]) -> list[Any]:
        nodes, depth, _, _ = self._descend(tokens)
        upto = nodes[:-1] if depth == len(tokens) else nodes
        return [n.entry for n in upto if n.entry is not None and n.entry.trimmable]

    def best(self, wanted: Sequence[int]) -> tuple[int, Any] | None:
        """The longest usable prefix of `wanted`: an exact entry, or a trimmable one cut back."""
        nodes, depth, partial, matched = self._descend(wanted)
        exact: tuple[int, Any] | None = None
        at = 0
        depths = []
        for node in nodes:
            at += len(node.edge)
            depths.append(at)
            if node.entry is not None:
                exact = (at, node.entry)
        floor = exact[0] if exact else 0
        # The deepest point of the matched path with a trimmable entry at or below it.
        if partial is not None and partial.num_trimmable and depth + matched > floor:
            return depth + matched, self._trimmable_below(partial)
        for node, d in zip(reversed(nodes), reversed(depths), strict=True):
            if d <= floor:
                break
            if node.num_trimmable:
                return d, self._trimmable_below(node)
        return exact

    @staticmethod
    def _trimmable_below(node: _Node) -> Any:
        while node.entry is None or not node.entry.trimmable:
            node = next(c for c in node.children.values() if c.num_trimmable)
        return node.entry


class PrefixIndex:
    """Every cached prefix, with the memory tier's LRU and byte budget."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._trie = TokenTrie()
        self._entries: dict[Tokens, IndexEntry] = {}
        self._lru: OrderedDict[Tokens, None] = OrderedDict()  # memory entries, oldest first
        self.nbytes = 0  # memory tier
        self.evictions = 0  # memory tier, since start
        # the keys of the last entries evicted and gone (to say a miss was one: `explain`)
        self._evicted = TokenTrie()
        self._evicted_keys: OrderedDict[Tokens, None] = OrderedDict()

    @property
    def num_memory_entries(self) -> int:
        return len(self._lru)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Tokens) -> bool:
        return tokens in self._entries

    def entry(self, tokens: Tokens) -> IndexEntry | None:
        return self._entries.get(tokens)

    # -- lookups --------------------------------------------------------------

    def best(self, prompt: Sequence[int]) -> Match | None:
        """The longest usable cached prefix of `prompt` (at most len(prompt) - 1 tokens)."""
        if len(prompt) < 2 or not self._entries:
            return None
        found = self._trie.best(prompt[: len(prompt) - 1])
        if found is None:
            return None
        n, entry = found
        return Match(entry.tokens, n, "memory" if entry.in_memory else "disk")

    def parting(self, prompt: Sequence[int]) -> int | None:
        """Where `prompt` parts from the cache with no snapshot to serve it there: how many
        of its first tokens some entry shares, where that is more than its best hit serves
        (a cache kind used only at exact offsets: `explain`'s "no-snapshot"); else None."""
        wanted = prompt[: len(prompt) - 1]
        shared = self._trie.shared(wanted)
        if shared == 0:
            return None
        match = self.best(prompt)
        return shared if match is None or match.num_tokens < shared else None

    def explain(self, prompt: Sequence[int], cached: int) -> tuple[PrefixMiss | None, int]:
        """Why a prompt whose cache hit serves `cached` tokens gets no more (None: it got
        all but its last token), and how many of its first tokens the entry that explains it
        shares (`PrefixMiss`): an entry sharing more that its cache kind cannot serve there,
        else one evicted, else where the prompt first differs from every entry."""
        wanted = prompt[: len(prompt) - 1]
        if cached >= len(wanted):
            return None, cached
        shared = self._trie.shared(wanted)
        if shared > cached:
            return "no-snapshot", shared
        gone = self._evicted.shared(wanted)
        if gone > cached:
            return "evicted", gone
        return ("diverged" if shared else "cold"), shared

    def touch(self, tokens: Tokens) -> None:
        if tokens in self._lru:
            self._lru.move_to_end(tokens)

    # -- what the store reports -----------------------------------------------

    def add_memory(self, info: EntryInfo) -> list[Tokens]:
        """Index an entry the store now holds in memory; returns the memory entries the
        store must drop (evicted, made redundant, or this one if it exceeds the budget)."""
        drops: list[Tokens] = []
        if info.nbytes > self.max_bytes:  # never fits: not kept in memory (disk may keep it)
            self._drop_memory(info.tokens)
            return [info.tokens]
        entry = self._get_or_add(info.tokens, info.trimmable)
        if entry.in_memory:
            self.nbytes -= entry.nbytes
        entry.in_memory, entry.nbytes = True, info.nbytes
        self.nbytes += info.nbytes
        self._lru[info.tokens] = None
        self._lru.move_to_end(info.tokens)
        if info.trimmable:  # its trimmable prefixes are redundant: it serves them all
            for shorter in self._trie.trimmable_prefixes(info.tokens):
                if shorter.in_memory:
                    self._drop_memory(shorter.tokens)
                    drops.append(shorter.tokens)
        while self.nbytes > self.max_bytes and self._lru:
            oldest = self._next_out()
            self._drop_memory(oldest)
            self.evictions += 1
            drops.append(oldest)
            if oldest not in self._entries:  # gone from every tier
                self._remember_evicted(oldest)
        return drops

    def _next_out(self) -> Tokens:
        """The memory entry to evict next: the least recently used of those a longer entry
        extends along one path (an older turn of one session), else the least recently used."""
        trie = self._trie
        for tokens in self._lru:
            if trie.num_branches(tokens) == 1:
                return tokens
        return next(iter(self._lru))

    def _remember_evicted(self, tokens: Tokens) -> None:
        if tokens in self._evicted_keys:
            return
        self._evicted_keys[tokens] = None
        self._evicted.add(IndexEntry(tokens, trimmable=False))
        while len(self._evicted_keys) > EVICTED_KEYS:
            old, _ = self._evicted_keys.popitem(last=False)
            self._evicted.remove(old)

    def remove_memory(self, tokens: Tokens) -> None:
        self._drop_memory(tokens)

    def add_disk(self, tokens: Tokens, trimmable: bool) -> None:
        self._get_or_add(tokens, trimmable).on_disk = True

    def remove_disk(self, tokens: Tokens) -> None:
        entry = self._entries.get(tokens)
        if entry is not None:
            entry.on_disk = False
            self._forget_if_unused(entry)

    def apply(
        self,
        new: Iterable[EntryInfo],
        disk_added: Iterable[EntryInfo] = (),
        disk_removed: Iterable[Tokens] = (),
        lost: Iterable[Tokens] = (),
    ) -> list[Tokens]:
        """Apply one step's report from the store; returns memory entries to drop."""
        for tokens in lost:
            self.remove_memory(tokens)
        for info in disk_added:
            self.add_disk(info.tokens, info.trimmable)
        for tokens in disk_removed:
            self.remove_disk(tokens)
        drops: list[Tokens] = []
        for info in new:
            drops.extend(self.add_memory(info))
        return drops

    # -- internals ------------------------------------------------------------

    def _get_or_add(self, tokens: Tokens, trimmable: bool) -> IndexEntry:
        entry = self._entries.get(tokens)
        if entry is None:
            entry = IndexEntry(tokens, trimmable)
            self._entries[tokens] = entry
            self._trie.add(entry)
        return entry

    def _drop_memory(self, tokens: Tokens) -> None:
        entry = self._entries.get(tokens)
        if entry is None or not entry.in_memory:
            return
        self._lru.pop(tokens, None)
        self.nbytes -= entry.nbytes
        entry.in_memory, entry.nbytes = False, 0
        self._forget_if_unused(entry)

    def _forget_if_unused(self, entry: IndexEntry) -> None:
        if not entry.in_memory and not entry.on_disk:
            self._entries.pop(entry.tokens, None)
            self._trie.remove(entry.tokens)


# -- requests that arrive together ------------------------------------------------------


@dataclass(frozen=True)
class PrefixPlan:
    """The policy's prefix-cache input for one step (see `plan_prefixes`)."""

    # waiting request -> prompt tokens its first chunk starts from (a cache hit)
    cached: Mapping[str, int] = field(default_factory=dict)
    # waiting request -> the entry it starts from
    matches: Mapping[str, Match] = field(default_factory=dict)
    # waiting requests not to start yet: an earlier request is computing their prefix, or
    # their best entry is on disk and is being loaded
    deferred: frozenset[str] = frozenset()
    promote: tuple[Tokens, ...] = ()  # disk entries to load into memory this step
    loading: frozenset[str] = frozenset()  # of `deferred`, those waiting for `promote`
    # waiting requests this plan looked at (only they may start this step); None: all
    considered: frozenset[str] | None = None


@dataclass(frozen=True)
class Candidate:
    """A request as `plan_prefixes` sees it."""

    request_id: str
    prompt: Sequence[int]
    num_computed_tokens: int
    checkpoints: tuple[int, ...]
    waiting: bool  # not started: its first chunk is still to be scheduled
    allow_disk: bool = True  # False once a disk entry was loaded for it and lost again


def plan_prefixes(candidates: Sequence[Candidate], index: PrefixIndex) -> PrefixPlan:
    """Where each waiting request starts, and which wait for a prefix being computed.

    `candidates` are running requests, then waiting ones in the order the policy admits
    them (`order.admission_key`, with fair share between clients: `order.fair_order`). A
    waiting request whose prompt shares a checkpointed prefix with an earlier request that
    has not reached that checkpoint yet waits for it, then starts from its snapshot (so
    requests that arrive together with one new system prompt compute it once). A request
    whose best entry is only on disk waits one step while the store loads it.
    """
    cached: dict[str, int] = {}
    matches: dict[str, Match] = {}
    deferred: set[str] = set()
    loading: set[str] = set()
    promote: list[Tokens] = []
    ahead: list[Candidate] = []  # earlier requests that are computing (or will compute)
    for c in candidates:
        if not c.waiting:
            ahead.append(c)
            continue
        match = index.best(c.prompt)
        if match is not None and match.source == "disk" and not c.allow_disk:
            match = None
        have = match.num_tokens if match else 0
        if _waits_for_checkpoint(c, have, ahead):
            deferred.add(c.request_id)
            continue
        if match is not None and match.source == "disk":
            deferred.add(c.request_id)
            loading.add(c.request_id)
            if match.tokens not in promote:
                promote.append(match.tokens)
            continue
        if match is not None:
            cached[c.request_id] = match.num_tokens
            matches[c.request_id] = match
        ahead.append(replace(c, num_computed_tokens=have))
    considered = frozenset(c.request_id for c in candidates if c.waiting)
    return PrefixPlan(
        cached, matches, frozenset(deferred), tuple(promote), frozenset(loading), considered
    )


def _waits_for_checkpoint(c: Candidate, have: int, ahead: Sequence[Candidate]) -> bool:
    prompt = c.prompt
    for other in ahead:
        for cp in other.checkpoints:
            if (
                have < cp < len(prompt)
                and cp > other.num_computed_tokens
                and other.prompt[:cp] == prompt[:cp]
            ):
                return True
    return False
