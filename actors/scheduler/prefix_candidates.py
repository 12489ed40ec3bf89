"""Which requests a step may look up a cached prefix for, and the plan's hits kept outside
image spans: what the core hands the prefix index (`plan_prefixes`) and takes back from it
before the policy runs.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import replace

from stepline.actors.scheduler.order import admission_key, fair_order
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_index import Candidate, PrefixPlan
from stepline.actors.scheduler.spans import inside_image
from stepline.events.fold import RequestState, Status


def prefix_candidates(
    states: Mapping[str, RequestState],
    prompt_of: Callable[[str], Sequence[int]],
    step: int,
    config: SchedulerConfig,
    disk_tried: Container[str],
) -> list[Candidate]:
    """The requests whose cached prefix step `step` may look up (`plan_prefixes`): those
    prefilling towards a checkpoint, and the head of the waiting queue in the admission
    order, fair share included (`max_num_seqs` of them, cache hits not known yet: none
    beyond it can start first). `disk_tried`: requests a disk entry was already loaded
    for."""

    def candidate(s: RequestState, *, waiting: bool) -> Candidate:
        return Candidate(
            request_id=s.request_id,
            prompt=prompt_of(s.request_id),
            num_computed_tokens=s.num_computed_tokens,
            checkpoints=s.checkpoints,
            waiting=waiting,
            allow_disk=s.request_id not in disk_tried,
        )

    running: list[Candidate] = []
    queue: list[RequestState] = []
    for s in sorted(states.values(), key=lambda s: s.admitted_seq):
        if s.status is Status.WAITING:
            queue.append(s)
        elif s.status is Status.PREFILLING and any(
            c > s.num_computed_tokens for c in s.checkpoints
        ):
            running.append(candidate(s, waiting=False))
    queue.sort(key=lambda s: admission_key(s, step, s.num_computed_tokens))
    order = fair_order(
        [(s, s.num_computed_tokens) for s in queue], states.values(), config.max_num_seqs
    )
    head = order[: config.max_num_seqs]
    return [*running, *(candidate(s, waiting=True) for s, _ in head)]


def outside_images(prefix: PrefixPlan, states: Mapping[str, RequestState]) -> PrefixPlan:
    """`prefix` with each cache hit that would end inside an image span of its request cut
    back to the span's start (none: before its first token). Keys of different images
    differ from their span's first token on (`spans.prompt_key`), so this is a guard; an
    entry that serves only at its exact length never ends inside a span (chunks do not)."""
    cut = {}
    for rid, n in prefix.cached.items():
        s = states.get(rid)
        image = inside_image(s.images, n) if s is not None and s.images else None
        if image is not None:
            cut[rid] = image.start
    if not cut:
        return prefix
    cached, matches = dict(prefix.cached), dict(prefix.matches)
    for rid, n in cut.items():
        if n == 0:
            cached.pop(rid)
            matches.pop(rid, None)
        else:
            cached[rid] = n
            if rid in matches:
                matches[rid] = replace(matches[rid], num_tokens=n)
    return replace(prefix, cached=cached, matches=matches)


def whole_prompt_pooled(prefix: PrefixPlan, states: Mapping[str, RequestState]) -> PrefixPlan:
    """`prefix` without a cache hit, or a wait for one, for an embedding request that pools
    more than its last token (mean, CLS), or whose prompt goes whole (a non-causal model's):
    its hidden states must be computed from the first token on, so it never starts from the
    prefix cache."""
    pooled = {
        rid
        for rid in (*prefix.cached, *prefix.deferred)
        if (s := states.get(rid)) is not None
        and s.params.embed is not None
        and (s.params.embed.pooling != "last" or s.params.embed.whole)
    }
    if not pooled:
        return prefix
    return replace(
        prefix,
        cached={r: n for r, n in prefix.cached.items() if r not in pooled},
        matches={r: m for r, m in prefix.matches.items() if r not in pooled},
        deferred=prefix.deferred - pooled,
        loading=prefix.loading - pooled,
    )
