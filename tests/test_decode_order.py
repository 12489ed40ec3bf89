"""The choice of order for decode-only steps: both tried, the faster kept, tried again later."""

from __future__ import annotations

from stepline.engine.decode_order import DecodeOrder

TRIAL = [True] * 3 + [False] * 6 + [True] * 3  # blocks of 3: first, second, second, first


def run_steps(order: DecodeOrder, rows: int, n: int, seconds: dict[bool, float]) -> list[bool]:
    """`n` steps of `rows` rows, each taking `seconds[its order]`; the orders chosen."""
    chosen = []
    for _ in range(n):
        pipelined = order.pipelined(rows)
        chosen.append(pipelined)
        order.record(rows, pipelined, seconds[pipelined])
    return chosen


def test_both_orders_are_tried_and_the_faster_is_kept():
    order = DecodeOrder(block_steps=3, retry_steps=100)
    chosen = run_steps(order, 8, 40, {True: 0.030, False: 0.040})
    assert chosen[:12] == TRIAL
    assert all(chosen[12:])
    order = DecodeOrder(block_steps=3, retry_steps=100)
    chosen = run_steps(order, 8, 40, {True: 0.050, False: 0.040})
    assert chosen[:12] == TRIAL
    assert not any(chosen[12:])


def test_a_steady_drift_does_not_decide():
    """Every step 2% slower than the last: the order tried first would look faster."""
    order = DecodeOrder(block_steps=4, retry_steps=100)
    for i in range(16):
        pipelined = order.pipelined(8)
        base = 0.040 * 1.02**i
        order.record(8, pipelined, base if pipelined else base * 0.97)  # reading first: 3% faster
    assert not order.pipelined(8)


def test_one_slow_step_and_block_starts_do_not_decide():
    order = DecodeOrder(block_steps=4, retry_steps=100)
    for i in range(16):
        pipelined = order.pipelined(8)
        seconds = 0.030 if pipelined else 0.040
        if i == 1:
            seconds = 0.500  # one slow pipelined step
        if i % 4 == 0:
            seconds = 1.0  # a block's first step is left out
        order.record(8, pipelined, seconds)
    assert order.pipelined(8)  # the median, not the mean


def test_each_batch_size_has_its_own_choice():
    order = DecodeOrder(block_steps=3, retry_steps=100)
    run_steps(order, 1, 15, {True: 0.010, False: 0.005})
    run_steps(order, 32, 15, {True: 0.050, False: 0.080})
    assert not order.pipelined(1)
    assert order.pipelined(32)


def test_the_choice_is_tried_again_after_retry_steps():
    order = DecodeOrder(block_steps=3, retry_steps=30)
    run_steps(order, 8, 25, {True: 0.050, False: 0.040})
    # the machine changed: the pipelined order is now the faster one
    chosen = run_steps(order, 8, 30, {True: 0.030, False: 0.040})
    assert chosen[:5] == [False] * 5  # still the old choice until 30 steps of this size
    assert chosen[5:17] == TRIAL
    assert all(chosen[17:])


def test_a_fixed_order_is_never_tried_against_the_other():
    for fixed in (True, False):
        order = DecodeOrder(block_steps=2, fixed=fixed)
        assert run_steps(order, 4, 10, {True: 0.05, False: 0.01}) == [fixed] * 10


def test_start_measures_each_decode_only_step_until_another_kind_interrupts():
    order = DecodeOrder(block_steps=2, retry_steps=100)
    now = 0.0
    for _ in range(8):  # the trial: each step 10 ms if pipelined, 20 ms if not
        pipelined = order.start(8, now)
        now += 0.010 if pipelined else 0.020
    order.interrupt()  # a step with a prefill chunk: 5 s long, never measured
    now += 5.0
    assert order.start(8, now)
