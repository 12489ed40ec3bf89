"""Memory freed after a burst goes back to the system: the C heap keeps what was freed until
it is trimmed, and the engine trims it when its step loop goes idle after work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import wait_until
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stepline.api import Engine, SamplingParams
from stepline.engine import heap

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's heap: elsewhere there is no trim"
)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@linux_only
def test_a_trim_gives_back_the_pages_a_burst_freed_inside_the_heap() -> None:
    blocks = [bytes(1000) for _ in range(200_000)]  # ~200 MB of malloc'd blocks
    kept = blocks[::64]  # one in 64 stays: the freed ones are holes inside the heap
    del blocks
    before = rss_mb()
    assert heap.trim()
    after = rss_mb()
    assert before - after > 50, (before, after)  # of ~195 MB freed
    assert kept  # held until here


def trims(engine: Engine) -> float:
    text = generate_latest(engine.metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "stepline_heap_trims_total":
                return sample.value
    raise AssertionError("no stepline_heap_trims_total")


@linux_only
@pytest.mark.asyncio
async def test_the_engine_trims_its_heap_once_each_time_it_goes_idle_after_work(demo) -> None:
    async with Engine.open("stepline-demo", max_step_ms=None) as engine:
        loop = engine.step_loop
        assert trims(engine) == 0  # nothing served yet: nothing to give back
        for n in (1, 2):
            outs = [
                o async for o in engine.generate([1, 2, 3], params=SamplingParams(max_tokens=3))
            ]
            assert outs[-1].finish_reason == "length"
            await wait_until(loop, lambda n=n: trims(engine) == n)
