"""The bulk reads agree with `apply`: what the summary and verify say of each request equals
what the fold says. Tests run `check_log` on hand-made logs of the shapes where the two could
part (tests/test_replay_why.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

from stepline.events.fold import FoldError, Status, fold
from stepline.events.log import (
    LogCorruptError,
    UnsupportedSchemaError,
    read_events,
    read_models,
    read_runs,
)
from stepline.events.replay import summarize, verify
from stepline.events.replay.stats import percentiles


def check_log(path: Path) -> bool:
    """Assert that the summary and verify of each run and model of the log agree with the
    fold of its events by `apply`. False (nothing checked) for a log the fold refuses (a
    test's broken log: verify reports it) or that cannot be read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn last line: the same for every reader
        try:
            runs = read_runs(path)
            models = read_models(path) or (None,)
            folds = {
                (run.index, model): fold(read_events(path, run=run.index, model=model))
                for run in runs
                for model in models
            }
        except (FoldError, LogCorruptError, UnsupportedSchemaError, OSError):
            return False
        for (run, model), states in folds.items():
            _agree(path, run, model, states, last=run == len(runs))
    return True


def _agree(path: Path, run: int, model: str | None, states: dict, *, last: bool) -> None:
    where = f"{path} run {run} model {model}"
    s = summarize(path, run=run, model=model, top=3)
    ended = [st for st in states.values() if st.is_finished]
    lone = [st for st in ended if not st.admitted]  # refused at a door: no latency
    outcomes: dict[str, int] = {}
    for st in states.values():
        key = (
            st.finish_reason.value if st.finish_reason else ("in-flight" if last else "interrupted")
        )
        outcomes[key] = outcomes.get(key, 0) + 1
    assert s.outcomes == outcomes, where
    assert s.num_output_tokens == sum(st.num_output_tokens for st in states.values()), where
    admitted = [st for st in states.values() if st not in lone]
    ttft = [st.first_token_ts - st.admitted_ts for st in admitted if st.first_token_ts]
    assert s.ttft_s == percentiles(ttft), where
    e2e_count = sum(1 for st in ended if st not in lone)
    assert s.e2e_s.count == e2e_count, where
    unfinished = {st.request_id: st for st in states.values() if not st.is_finished}
    left = {i.request_id: i for i in (*s.in_flight, *s.interrupted) if i.run == run}
    assert left.keys() == unfinished.keys(), where
    for rid, st in unfinished.items():
        seen = left[rid]
        assert seen.num_output_tokens == st.num_output_tokens, (where, rid)
        assert seen.num_computed_tokens == st.num_computed_tokens, (where, rid)
        if st.status is not Status.WAITING:  # (a cache hit alone leaves it waiting)
            assert seen.status == st.status, (where, rid)
    report = verify(path, run=run, model=model)  # (its rules on the log itself aside)
    gone = {i.request_id: i.num_output_tokens for i in (*report.in_flight, *report.interrupted)}
    assert gone == {rid: st.num_output_tokens for rid, st in unfinished.items()}, where
