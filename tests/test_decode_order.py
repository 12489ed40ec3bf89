"""The choice of order for decode-only steps: both tried, the faster kept, tried again later."""

from __future__ import annotations

from stepline.engine.decode_order import DecodeOrder


def run_steps(order: DecodeOrder, rows: int, n: int, seconds: dict[bool, float]) -> list[bool]:
    """`n` steps of `rows` rows, each taking `seconds[its order]`; the orders chosen."""
    chosen = []
    for _ in range(n):
        pipelined = order.pipelined(rows)
        chosen.append(pipelined)
        order.record(rows, pipelined, seconds[pipelined])
    return chosen


def test_both_orders_are_tried_and_the_faster_is_kept():
    order = DecodeOrder(trial_steps=4, retry_steps=100)
    chosen = run_steps(order, 8, 40, {True: 0.030, False: 0.040})
    assert chosen[:8] == [True] * 4 + [False] * 4
    assert all(chosen[8:])
    order = DecodeOrder(trial_steps=4, retry_steps=100)
    chosen = run_steps(order, 8, 40, {True: 0.050, False: 0.040})
    assert chosen[:8] == [True] * 4 + [False] * 4
    assert not any(chosen[8:])


def test_one_slow_step_does_not_decide():
    order = DecodeOrder(trial_steps=5, retry_steps=100)
    for pipelined, seconds in [(True, 0.030)] * 4 + [(True, 0.500)] + [(False, 0.040)] * 5:
        assert order.pipelined(8) == pipelined
        order.record(8, pipelined, seconds)
    assert order.pipelined(8)  # the median, not the mean


def test_each_batch_size_has_its_own_choice():
    order = DecodeOrder(trial_steps=3, retry_steps=100)
    run_steps(order, 1, 10, {True: 0.010, False: 0.005})
    run_steps(order, 32, 10, {True: 0.050, False: 0.080})
    assert not order.pipelined(1)
    assert order.pipelined(32)


def test_the_choice_is_tried_again_after_retry_steps():
    order = DecodeOrder(trial_steps=3, retry_steps=20)
    run_steps(order, 8, 15, {True: 0.050, False: 0.040})
    # the machine changed: the pipelined order is now the faster one
    chosen = run_steps(order, 8, 25, {True: 0.030, False: 0.040})
    assert chosen[:5] == [False] * 5  # still the old choice until 20 steps of this size
    assert chosen[5:11] == [True] * 3 + [False] * 3
    assert all(chosen[11:])


def test_a_fixed_order_is_never_tried_against_the_other():
    for fixed in (True, False):
        order = DecodeOrder(trial_steps=2, fixed=fixed)
        assert run_steps(order, 4, 10, {True: 0.05, False: 0.01}) == [fixed] * 10
