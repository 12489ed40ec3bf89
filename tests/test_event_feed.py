"""The live event feed (events/feed.py): a ring readers follow, resumed from the log file."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from stepline.events.feed import (
    EventFeed,
    EventFilter,
    EventFrame,
    Missed,
    Place,
    RunStarted,
    frames,
    parse_place,
)
from stepline.events.log import EventLogWriter
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    FinishReason,
    LogHeader,
    RequestParams,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)

ANY = EventFilter()
PARAMS = RequestParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=7)


def header(run_id: str = "run1") -> LogHeader:
    return LogHeader(created=1.0, model="demo", run_id=run_id, config={"max_step_ms": 50})


def life(rid: str, seq: int) -> list:
    """One request's events from `seq` on: admitted, a step, its token, its end (5 events)."""
    return [
        Admitted(
            seq=seq,
            ts=1.0,
            step=0,
            request_id=rid,
            num_prompt_tokens=3,
            prompt_token_ids=(1, 2, 3),
            prompt_sha256="ab" * 32,
            params=PARAMS,
        ),
        StepPlanned(
            seq=seq + 1,
            ts=1.1,
            step=1,
            request_ids=(rid,),
            num_tokens=(3,),
            kinds=("prefill",),
            max_step_tokens=64,
            max_num_seqs=8,
        ),
        TokensSampled(seq=seq + 2, ts=1.2, step=1, request_ids=(rid,), token_ids=(9,)),
        StepFinished(seq=seq + 3, ts=1.2, step=1, seconds=0.01),
        Terminal(seq=seq + 4, ts=1.3, step=1, request_id=rid, reason=FinishReason.STOP),
    ]


async def take(feed: EventFeed, after: Place | None, n: int, wanted: EventFilter = ANY) -> list:
    """The first `n` items after `after` (control items included)."""
    got: list = []
    with anyio.fail_after(5):
        async for batch in feed.follow(after, wanted):
            got.extend(batch)
            if len(got) >= n:
                break
    return got


def places(items: list) -> list[str]:
    return [str(i.place) for i in items if isinstance(i, EventFrame)]


async def test_a_reader_gets_the_events_in_memory_then_new_ones_in_order() -> None:
    feed = EventFeed(header())
    feed.publish(life("a", 1))
    got: list = []

    async def read() -> None:
        got.extend(await take(feed, None, 1 + 10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.wait_all_tasks_blocked()
        feed.publish(life("b", 6))
    assert isinstance(got[0], RunStarted) and got[0].key == "run1"
    assert places(got) == [f"run1.{n}" for n in range(1, 11)]


async def test_a_frame_is_the_logged_event_with_its_place_as_id_and_no_prompt_ids() -> None:
    feed = EventFeed(header())
    feed.publish(life("a", 1))
    got = await take(feed, None, 2)
    first = got[1].frame.decode()
    assert first.startswith("id: run1.1\ndata: ")
    body = json.loads(first.split("data: ", 1)[1])
    assert body["type"] == "admitted" and body["seq"] == 1 and body["prompt_token_ids"] is None
    assert body["num_prompt_tokens"] == 3 and "model" not in body


async def test_last_event_id_resumes_after_it_without_gaps_or_duplicates() -> None:
    feed = EventFeed(header())
    feed.publish(life("a", 1) + life("b", 6))
    got = await take(feed, parse_place("run1.4"), 1 + 6)
    assert places(got) == [f"run1.{n}" for n in range(5, 11)]


async def test_filters_pick_requests_models_and_types() -> None:
    feed = EventFeed(header())
    feed.publish(life("a", 1) + life("b", 6))
    by_request = await take(feed, None, 1 + 4, EventFilter(request_ids=frozenset({"b"})))
    kinds = [json.loads(i.frame.split(b"data: ")[1])["type"] for i in by_request[1:]]
    assert kinds == ["admitted", "step", "decoding", "terminal"]
    by_type = await take(feed, None, 1 + 2, EventFilter(types=frozenset({"terminal"})))
    assert places(by_type) == ["run1.5", "run1.10"]
    event = life("c", 11)[0]
    assert EventFilter(models=frozenset({"demo"})).matches(event, header())
    assert not EventFilter(models=frozenset({"another"})).matches(event, header())


async def test_a_reader_that_fell_behind_the_ring_is_told_how_many_it_missed() -> None:
    feed = EventFeed(header(), capacity=4)
    feed.publish(life("a", 1) + life("b", 6))  # 10 events: 7..10 kept
    got = await take(feed, parse_place("run1.2"), 1 + 1 + 4)
    missed = [i for i in got if isinstance(i, Missed)]
    assert [(str(m.after), m.num_missed) for m in missed] == [("run1.2", 4)]
    assert "--event-log" in missed[0].reason
    assert places(got) == ["run1.7", "run1.8", "run1.9", "run1.10"]


async def test_publishing_with_a_reader_that_never_reads_holds_only_the_ring() -> None:
    feed = EventFeed(header(), capacity=8)
    stuck = feed.follow(None)
    await stuck.__anext__()  # started, then never read again
    for i in range(1000):
        feed.publish(life(f"r{i}", 5 * i + 1))
    assert feed.last == 5000 and sum(e is not None for e in feed._events) == 8
    await stuck.aclose()


async def test_events_that_left_the_ring_are_read_back_from_the_log_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLogWriter(path, header()) as writer:
        feed = EventFeed(header(), log_path=path, flush=writer.flush, capacity=3)
        for events in (life("a", 1), life("b", 6)):
            writer.append_many(events)
            feed.publish(events)
        got = await take(feed, parse_place("run1.2"), 1 + 8)
    assert not [i for i in got if isinstance(i, Missed)]
    assert places(got) == [f"run1.{n}" for n in range(3, 11)]


async def test_after_a_restart_the_earlier_run_goes_on_from_the_file_then_the_new_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    with EventLogWriter(path, header("old")) as writer:
        writer.append_many(life("a", 1))
    with EventLogWriter(path, header("new"), append=True) as writer:
        feed = EventFeed(header("new"), log_path=path, flush=writer.flush)
        writer.append_many(life("b", 1))
        feed.publish(life("b", 1))
        got = await take(feed, parse_place("old.3"), 2 + 2 + 5)
    assert [i.key for i in got if isinstance(i, RunStarted)] == ["old", "new"]
    assert places(got) == ["old.4", "old.5"] + [f"new.{n}" for n in range(1, 6)]


async def test_after_a_restart_without_a_log_the_reader_is_told_the_old_run_is_lost() -> None:
    feed = EventFeed(header("new"))
    feed.publish(life("b", 1))
    got = await take(feed, parse_place("old.3"), 1 + 1 + 5)
    assert isinstance(got[0], Missed) and got[0].num_missed is None
    assert places(got) == [f"new.{n}" for n in range(1, 6)]


async def test_a_feed_of_a_file_reads_it_from_the_start_and_then_waits(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLogWriter(path, header("old")) as writer:
        writer.append_many(life("a", 1))
    feed = EventFeed(header("old"), log_path=path, live=False)
    got = await take(feed, None, 1 + 5)
    assert isinstance(got[0], RunStarted) and not got[0].live
    assert places(got) == [f"old.{n}" for n in range(1, 6)]
    text = frames(got).decode()
    assert text.startswith("event: run\ndata: ") and '"salt"' not in text


def test_a_place_is_its_run_and_number() -> None:
    assert parse_place(" abc.12 ") == Place("abc", 12)
    for bad in ("12", "abc.", ".3", "a.b"):
        with pytest.raises(ValueError):
            parse_place(bad)


async def test_a_views_catch_up_sends_the_state_now_not_all_memory_then_goes_on() -> None:
    from stepline.events.feed import VIEW_ENDED, VIEW_STEPS, CaughtUp

    feed = EventFeed(header())
    for i in range(400):  # 400 finished requests' lives: 2,000 events in memory
        feed.publish(life(f"done{i}", 5 * i + 1))
    running = life("running", 2001)[:3]  # admitted, scheduled, its first token; not ended
    feed.publish(running)
    got: list = []
    with anyio.fail_after(5):
        async for batch in feed.follow_view():
            got.extend(batch)
            if any(isinstance(i, CaughtUp) for i in got):
                break
    caught = next(i for i in got if isinstance(i, CaughtUp))
    sent = [json.loads(i.frame.split(b"data: ")[1]) for i in got if isinstance(i, EventFrame)]
    assert isinstance(got[0], RunStarted)
    # the last steps' plans and times and the shown requests' lives: not all memory holds
    assert caught.kept == 2003 and caught.sent == len(sent)
    assert len(sent) <= 2 * VIEW_STEPS + 5 * (VIEW_ENDED + 1) < caught.kept / 4
    assert str(caught.at) == "run1.2003"  # a resume from it misses nothing
    # the request in flight, all of its life so far, and the last ones that ended
    assert [e["type"] for e in sent if e.get("request_id") == "running"] == ["admitted"]
    assert {"step", "decoding"} <= {
        e["type"] for e in sent if "running" in e.get("request_ids", ())
    }
    ended = {e["request_id"] for e in sent if e["type"] == "terminal"}
    assert ended == {f"done{i}" for i in range(400 - VIEW_ENDED, 400)}
    assert caught.tokens_out["running"] == 1
    assert [e["seq"] for e in sent] == sorted(e["seq"] for e in sent)
    more: list = []  # then every event published after, as any reader gets it

    async def read() -> None:
        async for batch in feed.follow(caught.at):
            more.extend(batch)
            if len(places(more)) >= 5:
                break

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            feed.publish(life("next", 2004))
    assert places(more) == [f"run1.{n}" for n in range(2004, 2009)]


def looked_up(rid: str, seq: int, cached: int, prompt: int = 8) -> list:
    """A request's life from `seq` (6 events) whose first chunk started from `cached` of its
    `prompt` tokens in the prefix cache, then a second chunk."""
    admitted, step, *rest = life(rid, seq)
    admitted = admitted.model_copy(update={"num_prompt_tokens": prompt})
    first = ChunkPrefilled(
        seq=seq + 2, ts=1.1, step=1, request_id=rid, start=cached, end=prompt - 2,
        num_cached_tokens=cached,
    )  # fmt: skip
    second = ChunkPrefilled(
        seq=seq + 3, ts=1.1, step=2, request_id=rid, start=prompt - 2, end=prompt
    )
    return [admitted, step, first, second] + [e.model_copy(update={"seq": e.seq + 2}) for e in rest]


async def test_a_views_catch_up_counts_the_prefix_cache_over_the_whole_run() -> None:
    from stepline.events.feed import VIEW_ENDED, CaughtUp

    feed = EventFeed(header(), capacity=64)  # 300 requests' lives: memory keeps the last ten
    for i in range(300):
        feed.publish(looked_up(f"r{i}", 7 * i + 1, cached=4 if i % 3 == 0 else 0))
    refused = life("refused", 2101)  # ended before any step looked it up
    feed.publish([refused[0], refused[-1]])
    got: list = []
    with anyio.fail_after(5):
        async for batch in feed.follow_view():
            got.extend(batch)
            if any(isinstance(i, CaughtUp) for i in got):
                break
    caught = next(i for i in got if isinstance(i, CaughtUp))
    shown = {i.frame for i in got if isinstance(i, EventFrame) and b'"admitted"' in i.frame}
    assert len(shown) <= VIEW_ENDED < 300  # the lives it sends: a few of the run's requests
    # ... and the hit rate over all 300 that ran: 100 of them started from 4 cached tokens
    assert caught.prefix_cache == {
        "lookups": 300, "hits": 100, "prompt_tokens": 300 * 8, "cached_tokens": 100 * 4
    }  # fmt: skip
    body = json.loads(frames([caught]).decode().split("data: ", 1)[1])
    assert body["prefix_cache"] == caught.prefix_cache
