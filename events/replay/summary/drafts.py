"""Speculative decoding's drafts, as the steps verified them: the summary's `drafts`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from stepline.events.replay.stats import Report


class Drafts(Report):
    """Speculative decoding (actors/scheduler/drafter.py): drafted tokens the steps verified and
    how many the target model kept."""

    num_proposed: int  # drafted tokens, over every drafting decode row
    num_accepted: int  # of which kept
    num_rows: int  # decode rows that carried drafts
    num_requests: int  # requests that drafted

    @property
    def acceptance(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


class DraftTally:
    """Drafts per decode row from a step's plan (its tokens past the row's one), kept ones
    from the step's decoding event (the row's tokens past one)."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}  # this step's drafting rows -> drafts
        self.proposed = self.accepted = self.rows = 0
        self.requests: set[str] = set()

    def planned(self, ids: Sequence[str], tokens: Sequence[int], num_decode: int) -> None:
        pending = self.pending = {}
        for i in range(num_decode):
            if tokens[i] > 1:
                pending[ids[i]] = tokens[i] - 1
        if pending:
            self.proposed += sum(pending.values())
            self.rows += len(pending)
            self.requests.update(pending)

    def decoded(self, ids: Sequence[str]) -> dict[str, int]:
        """This step's kept drafts per drafting row ({} where none drafted)."""
        pending, self.pending = self.pending, {}
        if not pending:
            return {}
        counts = Counter(rid for rid in ids if rid in pending)
        kept = {rid: min(n, max(0, counts[rid] - 1)) for rid, n in pending.items()}
        self.accepted += sum(kept.values())
        return kept

    def report(self) -> Drafts | None:
        if not self.rows:
            return None
        return Drafts(
            num_proposed=self.proposed,
            num_accepted=self.accepted,
            num_rows=self.rows,
            num_requests=len(self.requests),
        )
