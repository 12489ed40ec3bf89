"""A model's load takes turns on the executor thread with the models that serve
(actors/turns.py `steps_for_turn`): while another model waits, a turn runs the load's steps
as long as they fit its budget, so a load neither holds the thread long nor waits for one of
the other model's steps after every short step of its own. A fixed cost model: each step
costs its seconds on the turn's clock."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from stepline.actors.turns import steps_for_turn


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def load(costs: Sequence[float], clock: Clock) -> Generator[None, None, str]:
    for cost in costs:
        clock.now += cost
        yield
    return "loaded"


def turns_of(
    costs: Sequence[float], waiting: bool = True, budget: float = 0.1
) -> tuple[list[float], str]:
    """Each turn's seconds, and what the load returned."""
    clock = Clock()
    steps, taken = load(costs, clock), []
    while True:
        start = clock.now
        done, value = steps_for_turn(steps, lambda: waiting, budget, clock)
        taken.append(round(clock.now - start, 6))
        if done:
            return taken, value


def test_while_another_model_waits_a_loads_turn_runs_the_steps_that_fit_its_budget():
    taken, value = turns_of([0.03] * 10)
    assert value == "loaded"
    assert taken == [0.09, 0.09, 0.09, 0.03]


def test_a_step_longer_than_the_budget_ends_its_turn():
    taken, _ = turns_of([0.02, 0.5, 0.02, 0.02])
    assert taken == [0.52, 0.04]


def test_with_no_other_model_waiting_a_load_runs_in_one_turn():
    taken, value = turns_of([0.03] * 10, waiting=False)
    assert (taken, value) == ([0.3], "loaded")


def test_with_a_budget_of_nothing_each_step_is_a_turn_of_its_own():
    taken, _ = turns_of([0.01] * 3, budget=0)
    assert taken == [0.01, 0.01, 0.01, 0.0]  # (the last finds the load's end)
