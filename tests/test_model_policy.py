"""The policy of a server of several models, without a model: whose step runs next on the one
executor thread (round robin between the models with work) and which models memory keeps."""

from __future__ import annotations

import anyio
import pytest
from anyio.lowlevel import checkpoint

from stepline.actors.scheduler.model_policy import (
    DoesNotFitError,
    Resident,
    expired,
    next_turn,
    to_unload,
)
from stepline.actors.turns import Turns

GB = 2**30


def test_turns_go_round_robin_between_the_models_that_wait():
    order = ("a", "b", "c")
    assert next_turn({"a", "b", "c"}, order, last="a") == "b"
    assert next_turn({"a", "c"}, order, last="a") == "c"
    assert next_turn({"a"}, order, last="a") == "a"  # alone: its turn again
    assert next_turn({"a", "b"}, order, last="c") == "a"  # wraps around
    assert next_turn({"a", "b"}, order, last=None) == "a"
    assert next_turn(set(), order, last="a") is None


def test_a_model_the_order_does_not_name_still_gets_its_turn():
    assert next_turn({"x"}, ("a", "b"), last="a") == "x"
    assert next_turn({"a", "x"}, ("a", "b"), last="a") == "x"
    assert next_turn({"a", "x"}, ("a", "b"), last="x") == "a"


def resident(name, gb, last_used, busy=False, pinned=False):
    return Resident(name, int(gb * GB), last_used, busy, pinned)


def test_a_model_that_fits_unloads_nobody():
    assert to_unload([resident("a", 1, 0)], need_bytes=2 * GB, budget_bytes=4 * GB) == []


def test_room_is_made_from_the_least_recently_used_idle_models_first():
    models = [resident("old", 1, 1), resident("older", 1, 0), resident("new", 1, 5)]
    assert to_unload(models, need_bytes=2 * GB, budget_bytes=4 * GB) == ["older"]
    assert to_unload(models, need_bytes=3 * GB, budget_bytes=4 * GB) == ["older", "old"]


def test_busy_and_pinned_models_are_never_unloaded_for_room():
    models = [resident("busy", 1, 0, busy=True), resident("pin", 1, 1, pinned=True)]
    models.append(resident("idle", 1, 2))
    assert to_unload(models, need_bytes=2 * GB, budget_bytes=4 * GB) == ["idle"]
    # Room only the busy and pinned ones could give: not now.
    assert to_unload(models, need_bytes=3 * GB, budget_bytes=4 * GB) is None


def test_a_model_larger_than_the_whole_budget_is_refused_naming_the_sizes():
    with pytest.raises(DoesNotFitError) as err:
        to_unload([], need_bytes=5 * GB, budget_bytes=4 * GB, name="big")
    assert "'big' needs 5.00 GB" in str(err.value) and "4.00 GB" in str(err.value)


def test_idle_models_past_their_time_to_live_expire_but_busy_and_pinned_ones_stay():
    models = [
        resident("stale", 1, last_used=0),
        resident("fresh", 1, last_used=95),
        resident("busy", 1, last_used=0, busy=True),
        resident("pinned", 1, last_used=0, pinned=True),
        resident("forever", 1, last_used=0),
    ]
    ttl = {"stale": 10.0, "fresh": 10.0, "busy": 10.0, "pinned": 10.0, "forever": None}
    assert expired(models, ttl, now=100.0) == ["stale"]


async def test_step_loops_of_two_models_alternate_on_the_executor():
    turns = Turns(("a", "b"))
    ran: list[str] = []

    async def loop(model: str) -> None:
        for _ in range(3):
            async with turns.turn(model):
                ran.append(model)
                await checkpoint()  # the step runs: the other loop asks for its turn

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop, "a")
            tg.start_soon(loop, "b")
    assert ran == ["a", "b", "a", "b", "a", "b"]


async def test_a_loop_cancelled_while_it_waits_for_its_turn_leaves_the_turns_working():
    turns = Turns(("a", "b", "c"))
    with anyio.fail_after(5):
        async with turns.turn("a"):
            async with anyio.create_task_group() as tg:

                async def wait_b() -> None:
                    async with turns.turn("b"):
                        raise AssertionError("b was cancelled before its turn")

                tg.start_soon(wait_b)
                await anyio.wait_all_tasks_blocked()
                assert turns.others_waiting("a")
                tg.cancel_scope.cancel()
        assert not turns.others_waiting("a")
        async with turns.turn("c"):  # nobody holds the turn: at once
            pass
