"""What a step ran under, in its `step-finished` event: whether the engine was still learning
its step times, and the host's load (the process's CPU share of the step, the machine's load
average), so that a slow step reads as a busy machine or as a bad plan. Clocks are handed
in: nothing here measures this machine."""

from __future__ import annotations

from core_driver import LIMITS, make_core, params, sampled

from stepline.actors.host import LOAD_EVERY_S, HostMeter, StepConditions
from stepline.actors.scheduler.core import SchedulerCore
from stepline.actors.scheduler.cost_model import CostModel, StepCost
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.models import StepFinished


class Clocks:
    """Wall and CPU clocks a test moves by hand, and a load average that counts its reads."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.reads = 0

    def load(self) -> float:
        self.reads += 1
        return 1.5 + self.reads


def test_a_steps_cpu_share_is_the_processs_cpu_over_its_wall_time():
    clocks = Clocks()
    meter = HostMeter(wall=lambda: clocks.wall, cpu=lambda: clocks.cpu, load_avg=clocks.load)
    meter.start()
    clocks.wall, clocks.cpu = 0.1, 0.05  # half a core: the machine's other work took the rest
    assert meter.stop(warming_up=False) == StepConditions(False, 0.5, 2.5)
    meter.start()
    clocks.wall, clocks.cpu = 0.2, 0.2  # a thread of BLAS beside the executor's
    assert meter.stop(warming_up=True) == StepConditions(True, 1.5, 2.5)


def test_the_load_average_is_read_at_most_every_half_second_and_reused_between():
    clocks = Clocks()
    meter = HostMeter(wall=lambda: clocks.wall, cpu=lambda: clocks.cpu, load_avg=clocks.load)
    loads = []
    for _ in range(100):  # 100 steps of 10 ms: a second
        meter.start()
        clocks.wall += 0.01
        loads.append(meter.stop(warming_up=False).load_avg)
    assert clocks.reads == int(1 / LOAD_EVERY_S) == len(set(loads))


def test_a_step_planned_before_the_cost_model_has_a_fit_is_logged_as_warming_up():
    timed = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_step_ms=100)
    learning = SchedulerCore(timed, LIMITS, cost_model=CostModel())  # no sample yet
    learned = make_core(config=timed, cost=StepCost(per_prefill_token=0.001))
    for core in (learning, learned):
        core.add("a", range(10), params())
        work = core.schedule()
        assert work is not None
        core.update_from_output(work, sampled(work), StepConditions(False, 0.9, 3.0))
    (first,) = [e for e in learning.take_events() if isinstance(e, StepFinished)]
    (second,) = [e for e in learned.take_events() if isinstance(e, StepFinished)]
    assert (first.warming_up, first.predicted_seconds) == (True, None)
    assert (second.warming_up, second.cpu_share, second.load_avg) == (False, 0.9, 3.0)
