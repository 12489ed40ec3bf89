"""The scheduling policy, without a model: build states, schedule, apply hand-made results."""

from __future__ import annotations

import random

import pytest

from stepline.engine.policy import (
    ContextLengthExceededError,
    EmptyPromptError,
    KVBudgetExceededError,
    SchedulerConfig,
    StepPlan,
    check_admissible,
    schedule,
)
from stepline.events.fold import RequestState, Status, apply
from stepline.events.models import Admitted, ChunkPrefilled, Decoding, RequestParams

PARAMS = RequestParams(max_tokens=8, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


class Sim:
    """Scheduling state driven only through events, as the step loop drives it."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.states: dict[str, RequestState] = {}
        self.seq = 0
        self.step = 0

    def _event(self, cls, **kw):
        self.seq += 1
        event = cls(seq=self.seq, ts=float(self.seq), step=self.step, **kw)
        self.states[event.request_id] = apply(self.states.get(event.request_id), event)

    def add(self, rid: str, n: int, checkpoints=(), max_tokens: int = 8) -> None:
        self._event(
            Admitted,
            request_id=rid,
            num_prompt_tokens=n,
            prompt_token_ids=None,
            prompt_sha256="x",
            checkpoints=tuple(checkpoints),
            params=PARAMS.model_copy(update={"max_tokens": max_tokens}),
        )

    def run_step(self) -> StepPlan:
        """Schedule a step and apply the results a model would produce."""
        self.step += 1
        plan = schedule(self.states, self.config, self.step)
        assert plan.num_tokens <= self.config.max_step_tokens
        assert len(plan.num_scheduled_tokens) <= self.config.max_num_seqs
        for rid in plan.decodes:
            self._event(Decoding, request_id=rid, token_ids=(7,))
        for c in plan.chunks:
            self._event(ChunkPrefilled, request_id=c.request_id, start=c.start, end=c.end)
            if c.is_final:
                self._event(Decoding, request_id=c.request_id, token_ids=(7,))
        return plan


def test_three_long_prompts_share_the_budget_then_decode_first():
    sim = Sim(SchedulerConfig(max_step_tokens=1024, long_prefill_cap=400))
    for rid in "abc":
        sim.add(rid, 800)
    steps = [sim.run_step() for _ in range(3)]
    assert [c.num_tokens for c in steps[0].chunks] == [400, 400, 224]
    assert [c.num_tokens for c in steps[1].chunks] == [400, 400, 224]
    assert steps[2].decodes == ("a", "b")
    assert [(c.request_id, c.num_tokens) for c in steps[2].chunks] == [("c", 352)]
    assert steps[2].num_tokens == 354


def test_every_prompt_is_covered_once_by_contiguous_chunks_within_budget():
    rng = random.Random(0)
    config = SchedulerConfig(max_step_tokens=97, max_num_seqs=5, long_prefill_cap=40)
    sim = Sim(config)
    lengths = {f"r{i}": rng.randint(1, 300) for i in range(20)}
    covered: dict[str, list[tuple[int, int]]] = {rid: [] for rid in lengths}
    for rid, n in lengths.items():
        sim.add(rid, n, max_tokens=rng.randint(1, 5))
    for _ in range(1000):
        plan = sim.run_step()
        for c in plan.chunks:
            covered[c.request_id].append((c.start, c.end))
        # requests that reached max_tokens end, as the step loop would end them
        for rid, s in list(sim.states.items()):
            if s.status is Status.DECODING and s.num_output_tokens >= s.params.max_tokens:
                sim.states[rid] = s.model_copy(update={"status": Status.FINISHED})
        if all(s.is_finished for s in sim.states.values()):
            break
    assert all(s.is_finished for s in sim.states.values())
    for rid, chunks in covered.items():
        assert chunks[0][0] == 0 and chunks[-1][1] == lengths[rid]
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))


def test_decodes_are_scheduled_before_any_prefill():
    sim = Sim(SchedulerConfig(max_step_tokens=10, max_num_seqs=4, long_prefill_cap=10))
    sim.add("d1", 3)
    sim.add("d2", 3)
    sim.run_step()  # both prefill fully and start decoding
    sim.add("long", 100)
    plan = sim.run_step()
    assert plan.decodes == ("d1", "d2")
    assert plan.chunks[0].num_tokens == 8  # what the decodes left


def test_a_running_request_given_no_tokens_in_a_step_is_kept_and_resumed():
    sim = Sim(SchedulerConfig(max_step_tokens=4, max_num_seqs=4))
    sim.add("a", 6)
    sim.add("b", 6)
    p1 = sim.run_step()
    assert [(c.request_id, c.num_tokens) for c in p1.chunks] == [("a", 4)]
    sim.add("x", 2)
    p2 = sim.run_step()  # a gets its last 2, b starts with 2
    assert [(c.request_id, c.start, c.end) for c in p2.chunks] == [("a", 4, 6), ("b", 0, 2)]
    p3 = sim.run_step()  # a decodes (1), b resumes with 3 of its 4 left; x gets nothing
    assert p3.decodes == ("a",)
    assert [(c.request_id, c.start, c.end) for c in p3.chunks] == [("b", 2, 5)]
    assert sim.states["b"].status is Status.PREFILLING
    p4 = sim.run_step()
    assert [(c.request_id, c.start) for c in p4.chunks][0] == ("b", 5)


def test_no_running_prefill_is_ever_skipped_under_random_load():
    rng = random.Random(1)
    for _ in range(300):
        budget = rng.randint(2, 12)
        config = SchedulerConfig(
            max_step_tokens=budget,
            max_num_seqs=rng.randint(1, budget),
            long_prefill_cap=rng.randint(1, budget),
        )
        sim = Sim(config)
        arrivals = sorted((rng.randint(0, 8), f"r{i}", rng.randint(1, 20)) for i in range(8))
        for step in range(30):
            for t, rid, n in arrivals:
                if t == step:
                    sim.add(rid, n, max_tokens=100)
            prefilling = [r for r, s in sim.states.items() if s.status is Status.PREFILLING]
            plan = sim.run_step()
            assert all(r in plan.num_scheduled_tokens for r in prefilling)


def test_max_num_seqs_holds_when_resuming_and_admitting():
    sim = Sim(SchedulerConfig(max_step_tokens=100, max_num_seqs=2, long_prefill_cap=10))
    for rid in "abcd":
        sim.add(rid, 30)
    for _ in range(6):
        plan = sim.run_step()
        assert len(plan.num_scheduled_tokens) <= 2
        running = [
            s for s in sim.states.values() if s.status in (Status.PREFILLING, Status.DECODING)
        ]
        assert len(running) <= 2
    assert sim.states["c"].status is Status.WAITING


def test_chunks_end_exactly_at_checkpoints():
    sim = Sim(SchedulerConfig(max_step_tokens=50, long_prefill_cap=50))
    sim.add("a", 120, checkpoints=(30, 60, 100))
    plans = [sim.run_step() for _ in range(3)]
    assert [(c.start, c.end, c.checkpoints) for p in plans for c in p.chunks] == [
        (0, 50, (30,)),
        (50, 100, (60, 100)),
        (100, 120, ()),
    ]


def test_kv_admission_waits_until_capacity_frees():
    sim = Sim(SchedulerConfig(max_step_tokens=64, max_kv_tokens=40))
    sim.add("a", 20, max_tokens=10)
    sim.add("b", 20, max_tokens=10)
    plan = sim.run_step()
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert sim.states["b"].status is Status.WAITING


def test_inadmissible_requests_say_why():
    config = SchedulerConfig(max_kv_tokens=100)
    with pytest.raises(EmptyPromptError, match="empty"):
        check_admissible(0, 10, 2048, config)
    with pytest.raises(ContextLengthExceededError, match="3000 tokens.*2048") as err:
        check_admissible(3000, 10, 2048, config)
    assert (err.value.num_prompt_tokens, err.value.max_context) == (3000, 2048)
    with pytest.raises(ValueError, match="max_tokens"):
        check_admissible(50, 80, 2048, config)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(max_step_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="every running request decodes"):
        SchedulerConfig(max_step_tokens=16, max_num_seqs=32)


def test_a_fixed_per_request_kv_cost_counts_against_the_budget():
    # 20 + 10 tokens each fit twice in 70, but not with 10 tokens' worth of recurrent state each
    sim = Sim(SchedulerConfig(max_step_tokens=64, max_kv_tokens=70, kv_tokens_per_seq=10))
    sim.add("a", 20, max_tokens=10)
    sim.add("b", 20, max_tokens=10)
    plan = sim.run_step()
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert sim.states["b"].status is Status.WAITING


def test_a_request_past_the_kv_budget_is_refused_in_tokens_and_gb():
    config = SchedulerConfig(max_kv_tokens=2**20, kv_bytes_per_token=2048)  # 2 GB
    with pytest.raises(KVBudgetExceededError) as err:
        check_admissible(2**20, 1, 2**22, config)
    assert (err.value.num_kv_tokens, err.value.max_kv_tokens) == (2**20 + 1, 2**20)
    assert "1048577 tokens, 2 GB" in str(err.value) and "1048576 tokens, 2 GB" in str(err.value)
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=0)
