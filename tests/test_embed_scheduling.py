"""An indexing job's embedding requests share steps with chat streams without stalling them:
with a fixed cost model (no timing), every step beside the streams stays within the step's
time for embedding work, and every document still gets its vector."""

from __future__ import annotations

from core_driver import make_core, params, sampled

from stepline.actors.scheduler.budget import EMBED_STRETCH
from stepline.actors.scheduler.cost_model import StepCost, StepFeatures
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.work import StepResult
from stepline.events.models import EmbedParams

# A busy 2-core CPU's SmolLM2, roughly: 4 decode rows take 130 ms (past the 100 ms target), a
# prompt token 2 ms, a forward of its own (an embedding chunk's) 40 ms.
COST = StepCost(
    step=0.05, per_decode_row=0.02, per_prefill_token=0.002, per_chunk=0.002,
    per_separate_decode=0.04,
)  # fmt: skip
CONFIG = SchedulerConfig(max_step_tokens=2048, max_num_seqs=64, max_step_ms=100.0)
EMBED = params(max_tokens=0, embed=EmbedParams(pooling="last"))


def embedded(work) -> StepResult:
    """`sampled`, plus a vector for each embedding request whose final chunk ran."""
    vectors = {c.request_id: (1.0, 0.0) for c in work.plan.chunks if c.is_final}
    return sampled(work, embeddings=vectors)


def streams_and_documents(num_docs: int, doc_tokens=range(64, 513, 29)):
    core = make_core(config=CONFIG, cost=COST)
    for i in range(4):
        core.add(f"chat{i}", (3, 4, 5, 6), params(max_tokens=10_000))
    core.update_from_output(work := core.schedule(), sampled(work))  # the streams decode
    lengths = list(doc_tokens)
    for i in range(num_docs):
        core.add(f"doc{i}", tuple(range(3, 3 + lengths[i % len(lengths)])), EMBED)
    return core


def test_an_indexing_job_beside_four_streams_keeps_every_step_within_its_stretch():
    core = streams_and_documents(48)
    decode_only = COST.predict(StepFeatures(decode_rows=4))
    longest = max(CONFIG.max_step_ms / 1e3, EMBED_STRETCH * decode_only)
    done: set[str] = set()
    for _ in range(2_000):
        work = core.schedule()
        assert work is not None
        plan = work.plan
        assert len(plan.decodes) == 4  # the streams decode every step
        # one token more than fits is the floor that keeps the job moving
        floor = COST.predict(plan.features) - COST.per_prefill_token
        assert plan.predicted_seconds is not None and floor <= longest + 1e-9, plan
        out = core.update_from_output(work, embedded(work))
        done |= {rid for rid, u in out.updates.items() if u.embedding is not None}
        if len(done) == 48:
            break
    assert done == {f"doc{i}" for i in range(48)}  # nobody starved


def test_an_embedding_chunk_is_priced_with_its_own_forward_and_whole_ones_share_one():
    core = streams_and_documents(3, doc_tokens=(2,))
    plan = core.schedule().plan
    chunks = [c for c in plan.chunks if c.request_id.startswith("doc")]
    assert [(c.start, c.end) for c in chunks] == [(0, 2)] * 3  # three whole short documents
    assert plan.features.separate_decode == 1  # their batched forward, beside the decode one
