"""What the scheduler core keeps of requests beside their fold state, in one owner.

A request's scheduling facts are its `RequestState` (events/fold.py). The core keeps a few
facts the fold does not hold, none of them in the log: the ids it has seen (to refuse one
reused), its recently ended states (for inspection), what the executor must still free,
and for a live request its drafter, its loop guard, its images' encoder inputs and whether
a disk entry was loaded for it. `RequestBook` holds them all, and `ended` lets a request go
from every one at once. It also tells the drafters what each step proposed, planned and kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from stepline.actors.scheduler.drafter import Drafter
from stepline.actors.scheduler.loop_guard import LoopGuard
from stepline.actors.scheduler.plan import StepPlan
from stepline.actors.scheduler.spans import PromptImage
from stepline.events.fold import RequestState, Status
from stepline.events.models import FinishReason, PrefixMiss

# ended cleanly: cache worth keeping
_REUSABLE = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.LOOP)
_KEEP_IDS = 100_000  # request ids refused as reused within this many requests
_KEEP_FINISHED = 1024  # ended requests' states kept for inspection
# ... and at most this many prompt token ids among them (a 128k-token prompt's state holds
# 128k of them: 1,024 such states would keep gigabytes alive).
_KEEP_FINISHED_TOKENS = 262_144


class RequestBook:
    def __init__(self) -> None:
        self.finished: OrderedDict[str, RequestState] = OrderedDict()  # the recent ended ones
        self._finished_tokens = 0  # prompt token ids held in `finished`
        self._seen: OrderedDict[str, None] = OrderedDict()  # to refuse reused ids
        # ended since the executor last heard -> whether its cache is worth keeping
        self.to_free: dict[str, bool] = {}
        # live request -> its prompt lookup, while it may draft (actors/scheduler/drafter.py)
        self.drafters: dict[str, Drafter] = {}
        # live request -> its generated tokens as a loop needs them, where it has a loop guard
        # (`RequestParams.loop_guard`; actors/scheduler/loop_guard.py)
        self.loop_guards: dict[str, LoopGuard] = {}
        self.disk_tried: set[str] = set()  # live requests a disk entry was loaded for
        # waiting request -> its images' encoder inputs (pixels: not the fold's, not logged),
        # until its first chunk hands them to the executor
        self._images: dict[str, tuple[PromptImage, ...]] = {}
        # starting request -> why its cache hit stops where it does, and how far its prompt
        # matched (`PrefixIndex.explain`), until its first step's event records it
        self._misses: dict[str, tuple[PrefixMiss | None, int]] = {}
        # waiting request -> the checkpoint the core added for the prefix cache, until it
        # starts (`NewRequest.own_checkpoint`)
        self.own_checkpoints: dict[str, int] = {}

    def has_seen(self, request_id: str) -> bool:
        return request_id in self._seen

    def remember(self, request_id: str) -> None:
        """An id that may not be used again (within the last `_KEEP_IDS`)."""
        self._seen[request_id] = None
        while len(self._seen) > _KEEP_IDS:
            self._seen.popitem(last=False)

    def admitted(
        self,
        request_id: str,
        images: Sequence[PromptImage],
        drafter: Drafter | None,
        loop_guard: bool = False,
    ) -> None:
        if images:  # what the encoder reads, until the executor has it
            self._images[request_id] = tuple(images)
        if drafter is not None:
            self.drafters[request_id] = drafter
        if loop_guard:
            self.loop_guards[request_id] = LoopGuard()

    def take_images(self, request_id: str) -> tuple[PromptImage, ...]:
        """A starting request's images' encoder inputs, for the executor (once)."""
        return self._images.pop(request_id, ())

    def missed(self, request_id: str, miss: tuple[PrefixMiss | None, int]) -> None:
        """A starting request's prefix-cache miss (`PrefixIndex.explain`), for its first
        step's event."""
        self._misses[request_id] = miss

    def take_miss(self, request_id: str) -> dict[str, Any]:
        """The fields of its first step's event that say why its cache hit stops there
        (none: no prefix cache, or not its first step), once."""
        miss = self._misses.pop(request_id, None)
        if miss is None or miss[0] is None:
            return {}
        return {"prefix_miss": miss[0], "prefix_shared": miss[1]}

    def cache_source(self, request_id: str) -> str:
        """Where a request's cache hit came from. An entry on disk is loaded into memory
        while its request waits (`plan_prefixes` never starts one from disk): a request a
        disk entry was loaded for was served from disk."""
        return "disk" if request_id in self.disk_tried else "memory"

    def ended(self, request_id: str, state: RequestState) -> None:
        """Request `request_id` ended as `state`: kept among the recent ones, to be freed
        by the executor unless it never reached it (rejected), and nothing else kept."""
        self._keep_finished(request_id, state)
        reason = state.finish_reason
        if reason is not FinishReason.REJECTED:  # else it never reached the executor
            self.to_free[request_id] = reason in _REUSABLE
        self.disk_tried.discard(request_id)
        self._images.pop(request_id, None)
        self._misses.pop(request_id, None)
        self.own_checkpoints.pop(request_id, None)
        self.drafters.pop(request_id, None)
        self.loop_guards.pop(request_id, None)

    def propose_drafts(
        self, states: Mapping[str, RequestState]
    ) -> dict[str, tuple[int, ...]] | None:
        """Each decoding request's drafts, where it drafts this step (`Drafter.propose`);
        None where no request may draft."""
        if not self.drafters:
            return None
        out = {}
        for rid, drafter in self.drafters.items():
            state = states[rid]
            if state.status is Status.DECODING and not state.parked:
                drafts = drafter.propose()
                if drafts is not None:
                    out[rid] = drafts
        return out

    def drafts_planned(self, plan: StepPlan) -> None:
        """Each drafting decode row's drafter hears what the plan gave it."""
        for rid, drafter in self.drafters.items():
            if rid in plan.decodes:
                drafter.planned(plan.drafts.get(rid))

    def drafts_verified(
        self,
        proposed: Mapping[str, tuple[int, ...]],
        accepted: Mapping[str, tuple[int, ...]],
        live: Sequence[tuple[str, list[int]]],
    ) -> None:
        """Each drafting request's drafter takes the step's tokens in, and hears how many of
        its drafts were kept where they were verified (a row that starts drafting where the
        batch's forward was built a step ahead decodes there that step, unverified)."""
        drafters = self.drafters
        if not drafters:
            return
        for rid, tokens in live:
            drafter = drafters.get(rid)
            if drafter is None:
                continue
            if rid in accepted:
                drafter.observe(len(proposed.get(rid, ())), len(accepted[rid]))
            drafter.extend(tokens)

    def take_frees(self) -> dict[str, bool]:
        """What the executor must free (request -> whether its cache is worth keeping), once."""
        frees, self.to_free = self.to_free, {}
        return frees

    def _keep_finished(self, rid: str, state: RequestState) -> None:
        old = self.finished.pop(rid, None)
        if old is not None:
            self._finished_tokens -= _num_ids(old)
        self.finished[rid] = state
        self._finished_tokens += _num_ids(state)
        while len(self.finished) > 1 and (
            len(self.finished) > _KEEP_FINISHED or self._finished_tokens > _KEEP_FINISHED_TOKENS
        ):
            _, dropped = self.finished.popitem(last=False)
            self._finished_tokens -= _num_ids(dropped)


def _num_ids(state: RequestState) -> int:
    return len(state.prompt_token_ids or ())
