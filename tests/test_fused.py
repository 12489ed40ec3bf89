"""One forward per step: prompt chunks and decode rows share the model's weights, and every
request gets what separate forwards (and mlx-lm alone) give it."""

from __future__ import annotations

import random
from dataclasses import replace

import anyio
import mlx.core as mx
import mlx.nn as nn
import pytest
from families import FAMILIES, build
from helpers import mlx_lm_greedy, small_config
from mlx_lm.models.cache import make_prompt_cache

from stepline.actors.scheduler.plan import ScheduledChunk, SchedulerConfig, StepPlan
from stepline.actors.scheduler.warmup import measure_step_costs
from stepline.actors.scheduler.work import PREFILL_FAILED, NewRequest, StepWork
from stepline.api import Engine, SamplingParams
from stepline.engine import fused
from stepline.engine import step as step_module
from stepline.engine.models import LoadedModel
from stepline.engine.runner import ModelRunner
from stepline.events.models import RequestParams

GREEDY = RequestParams(max_tokens=64, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


def prompt_ids(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _random_model(arch: str, demo: LoadedModel, **extra) -> LoadedModel:
    """A small random model of mlx-lm's `arch` module, with the demo's tokenizer."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = small_config(
        model_type=arch,
        vocab_size=demo.model.args.vocab_size,
        tie_word_embeddings=False,
        **extra,
    )
    mx.random.seed(7)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return replace(demo, model=model, name=f"random-{arch}")


# Families that fuse beyond llama and Qwen2/3 (tests/families.py's tiny models of them):
# plain KV layers, sliding windows of 16 tokens that the prompts below wrap, and hybrids
# whose recurrent mixers (gated delta, Mamba2, short convolutions) run per segment.
FUSED_FAMILIES = {
    "qwen3_moe": "Qwen3-MoE",
    "phi3": "Phi-3",
    "ministral3": "Ministral 3",
    "mistral3": "Mistral 3 (a llama text model)",
    "ministral3-sliding": "Ministral 3, sliding window",
    "gemma3_text": "Gemma 3 (text)",
    "gemma4_text": "Gemma 4 (text)",
    "gpt_oss": "gpt-oss (sliding window, sinks, MoE)",
    "glm4_moe": "GLM-4.5 (MoE)",
    "granite": "Granite 3",
    "cohere2": "Command R7B (sliding windows)",
    "qwen3_5": "Qwen3.5 (Gated DeltaNet hybrid)",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "nemotron_h": "Nemotron-H (Mamba2 hybrid)",
    "granitemoehybrid": "Granite 4.0-H (Mamba2 hybrid, MoE)",
    "lfm2": "LFM2 (short-convolution hybrid)",
}


@pytest.fixture(params=["llama", "qwen3", "qwen2", "demo_sliding", "demo_hybrid", *FUSED_FAMILIES])
def plain(request, demo) -> LoadedModel:
    """The covered architectures: the llama, sliding-window and hybrid (gated-delta) demos,
    Qwen3- and Qwen2-shaped models, and the other families that fuse."""
    if request.param == "llama":
        return demo
    if request.param in ("demo_sliding", "demo_hybrid"):
        return request.getfixturevalue(request.param)
    if request.param in FUSED_FAMILIES:
        family = next(f for f in FAMILIES if f.name == FUSED_FAMILIES[request.param])
        model = build(family, vocab_size=demo.vocab_size)
        return replace(demo, model=model, name=f"random-{request.param}")
    extra = {"head_dim": 16} if request.param == "qwen3" else {}
    return _random_model(request.param, demo, **extra)


def _prefilled(model: nn.Module, prompt: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    return cache


def test_a_fused_forward_gives_each_segment_the_logits_of_its_own_forward(plain):
    """Decode rows of different lengths (left padding) beside a chunk that continues a
    prompt, a whole short prompt and a one-token chunk: each gets its separate forward's
    logits, and the caches continue exactly as theirs do."""
    model = plain.model
    assert fused.fused_forward_works(model)
    rows = [prompt_ids(n, seed=n) for n in (40, 3, 17)]
    last = mx.array([r[-1] for r in rows])
    chunks = [(prompt_ids(30, seed=1), 12), (prompt_ids(9, seed=2), 0), (prompt_ids(5, seed=3), 4)]

    def caches():
        batch = [
            type(layers[0]).merge(list(layers))
            for layers in zip(*(_prefilled(model, r[:-1]) for r in rows), strict=True)
        ]
        own = [
            _prefilled(model, p[:done]) if done else make_prompt_cache(model) for p, done in chunks
        ]
        return batch, own

    batch, own = caches()
    want = [
        model(mx.array(p[done:])[None], cache=c)[0]
        for (p, done), c in zip(chunks, own, strict=True)
    ]
    want_rows = model(last[:, None], cache=batch)[:, -1, :]

    fused_batch, fused_own = caches()
    segments = [
        fused.Segment(mx.array(p[done:]), c) for (p, done), c in zip(chunks, fused_own, strict=True)
    ]
    segments.append(fused.Segment(last, fused_batch, is_batch=True))
    every = [list(range(len(p) - done)) for p, done in chunks]
    *got, got_rows = fused.forward(model, segments, [*every, [0, 1, 2]])
    assert mx.allclose(got_rows, want_rows, atol=1e-4)
    for g, w in zip(got, want, strict=True):
        assert g is not None and g.shape == w.shape and mx.allclose(g, w, atol=1e-4)
    # the caches hold the same keys: the next token gives the same logits
    nxt = mx.array([[7]])
    for mine, theirs in zip(fused_own, own, strict=True):
        assert mx.allclose(model(nxt, cache=mine), model(nxt, cache=theirs), atol=1e-4)
    nxt = mx.array([[7], [8], [9]])
    assert mx.allclose(model(nxt, cache=fused_batch), model(nxt, cache=batch), atol=1e-4)


def test_a_hybrid_models_steps_fuse_its_recurrent_layers_run_per_segment(demo_hybrid):
    """The hybrid model's gated-delta layers run once a segment, against each request's
    own state, inside the step's one forward (`fused.install_mixers`)."""
    assert fused.fused_forward_works(demo_hybrid.model)
    assert ModelRunner(demo_hybrid).fuse


class Counting:
    """Counts the runner's forwards by kind: fused, a chunk's own, the decode batch's."""

    def __init__(self, monkeypatch, runner: ModelRunner):
        self.calls: list[str] = []
        real_fused, real_forward = fused.run, step_module.forward
        real_decode = runner.forwards.decode

        def fused_forward(*a, **kw):
            self.calls.append("fused")
            return real_fused(*a, **kw)

        def chunk_forward(*a, **kw):
            self.calls.append("chunk")
            return real_forward(*a, **kw)

        def decode_forward(*a, **kw):
            self.calls.append("decode")
            return real_decode(*a, **kw)

        monkeypatch.setattr(fused, "run", fused_forward)
        monkeypatch.setattr(step_module, "forward", chunk_forward)
        runner.forwards.decode = decode_forward

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def _capture_sampled(runner: ModelRunner) -> list[mx.array]:
    """The logits each step samples from (not those built a step ahead)."""
    seen: list[mx.array] = []
    start, build = runner.sampler.start, runner.lookahead.build
    building = [False]

    def spy(logits, *a, **kw):
        if not building[0]:
            seen.append(logits)
        return start(logits, *a, **kw)

    def build_ahead(*a, **kw):
        building[0] = True
        try:
            return build(*a, **kw)
        finally:
            building[0] = False

    runner.sampler.start, runner.lookahead.build = spy, build_ahead
    return seen


PROMPTS = {"a": prompt_ids(30, seed=11), "b": prompt_ids(7, seed=12), "c": prompt_ids(50, seed=13)}
PROMPTS["d"] = prompt_ids(12, seed=14)


def _mixed_steps(runner: ModelRunner) -> list[dict[str, int]]:
    """a and b prefill whole and c starts (two finals and a chunk); then c's middle chunk
    beside a and b decoding and d's whole prompt; then c's final chunk beside three decode
    rows of different lengths; then four decode-only steps."""
    news = {rid: NewRequest(rid, tuple(p), GREEDY) for rid, p in PROMPTS.items()}

    def chunk(rid: str, start: int, end: int) -> ScheduledChunk:
        return ScheduledChunk(rid, start, end, (), end == len(PROMPTS[rid]))

    steps = [
        ((), (chunk("a", 0, 30), chunk("b", 0, 7), chunk("c", 0, 20)), ("a", "b", "c")),
        (("a", "b"), (chunk("c", 20, 40), chunk("d", 0, 12)), ("d",)),
        (("a", "b", "d"), (chunk("c", 40, 50),), ()),
        *[(("a", "b", "d", "c"), (), ())] * 4,
    ]
    out = []
    for i, (decodes, chunks, admit) in enumerate(steps):
        num = {rid: 1 for rid in decodes} | {c.request_id: c.num_tokens for c in chunks}
        plan = StepPlan(step=i + 1, decodes=decodes, chunks=chunks, num_scheduled_tokens=num)
        work = StepWork(plan=plan, admit=tuple(news[rid] for rid in admit))
        result = runner.run(work)
        assert not result.failed
        out.append(dict(result.tokens))
        runner.look_ahead()
    return out


def test_a_mixed_step_runs_one_forward_and_samples_what_separate_forwards_give(plain, monkeypatch):
    """Several chunks, a final chunk and decode rows of different lengths in one step: one
    forward each, no look-ahead while a prompt is mid-prefill, the logits of a runner that
    runs separate forwards, and every request's greedy tokens are mlx-lm's own."""
    fused_runner, separate = ModelRunner(plain), ModelRunner(plain, fuse=False, lookahead=False)
    assert fused_runner.fuse
    counted = Counting(monkeypatch, fused_runner)
    sampled, sampled_separately = _capture_sampled(fused_runner), _capture_sampled(separate)

    tokens = _mixed_steps(fused_runner)
    calls = counted.take()
    assert tokens == _mixed_steps(separate)
    assert calls[:3] == ["fused"] * 3  # steps 1-3: one forward each; then decodes
    assert "chunk" not in calls
    assert len(sampled) == 3  # then the decode-only steps sample what was built ahead
    for got, want in zip(sampled, sampled_separately[:3], strict=True):
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4)
    for rid, prompt in PROMPTS.items():
        ours = [step[rid] for step in tokens if rid in step]
        assert ours == mlx_lm_greedy(plain.model, prompt, len(ours)), rid


def test_a_fault_building_a_fused_forward_ends_only_the_request_it_comes_from(demo):
    """The fused forward cannot be built (one request's cache raises): every cache is put
    back, the step runs separate forwards, and only that request ends."""
    runner, reference = ModelRunner(demo), ModelRunner(demo, fuse=False)
    assert runner.fuse
    prompts = {"x": prompt_ids(20, seed=1), "doomed": prompt_ids(30, seed=2)}
    prompts["y"] = prompt_ids(9, seed=3)
    news = {rid: NewRequest(rid, tuple(p), GREEDY) for rid, p in prompts.items()}
    first = StepPlan(
        step=1,
        chunks=(ScheduledChunk("x", 0, 20, (), True), ScheduledChunk("doomed", 0, 10, (), False)),
        num_scheduled_tokens={"x": 20, "doomed": 10},
    )
    second = StepPlan(
        step=2,
        decodes=("x",),
        chunks=(
            ScheduledChunk("doomed", 10, 30, (), True),
            ScheduledChunk("y", 0, 9, (), True),
        ),
        num_scheduled_tokens={"x": 1, "doomed": 20, "y": 9},
    )
    want = [reference.run(StepWork(plan=first, admit=(news["x"], news["doomed"])))]
    want.append(reference.run(StepWork(plan=second, admit=(news["y"],))))
    runner.run(StepWork(plan=first, admit=(news["x"], news["doomed"])))

    def broken(keys, values):
        raise RuntimeError("injected cache fault")

    # its second layer: every segment's first layer has taken the step's tokens by then
    runner._seqs["doomed"].cache[1].update_and_fetch = broken
    result = runner.run(StepWork(plan=second, admit=(news["y"],)))
    assert result.failed == {"doomed": PREFILL_FAILED}
    assert result.tokens == {rid: t for rid, t in want[1].tokens.items() if rid != "doomed"}
    # the others decode on exactly
    third = StepPlan(step=3, decodes=("x", "y"), num_scheduled_tokens={"x": 1, "y": 1})
    assert runner.run(StepWork(plan=third)).tokens == {
        "x": mlx_lm_greedy(demo.model, prompts["x"], 3)[2],
        "y": mlx_lm_greedy(demo.model, prompts["y"], 2)[1],
    }


async def test_a_long_prompt_beside_decoding_streams_fuses_and_changes_no_token(
    demo, model_cache_dir, monkeypatch
):
    """End to end: while a long prompt prefills in chunks, the decoding requests ride in its
    chunks' forwards, and every request's greedy tokens are mlx-lm's own."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    short = [prompt_ids(8 + 5 * i, seed=30 + i) for i in range(3)]
    long = prompt_ids(200, seed=40)
    results: dict[int, list[int]] = {}
    async with Engine.open("stepline-demo", max_step_tokens=32, max_num_seqs=8) as engine:
        counted = Counting(monkeypatch, engine.step_loop.runner)

        decoding = anyio.Event()  # every short request has two tokens

        async def one(i: int, prompt: list[int]) -> None:
            got = results.setdefault(i, [])
            async for out in await engine.submit(prompt, params=params):
                got.extend(out.token_ids)
                if all(len(results.get(j, ())) >= 2 for j in range(3)):
                    decoding.set()

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(short):
                tg.start_soon(one, i, prompt)
            with anyio.fail_after(30):
                await decoding.wait()
            tg.start_soon(one, 3, long)  # while they decode
    assert counted.take().count("fused") >= 3  # the long prompt's chunks, beside decode rows
    for i, prompt in enumerate([*short, long]):
        assert results[i] == mlx_lm_greedy(demo.model, prompt, 16), i


def test_a_mixed_step_where_steps_do_not_fuse_runs_separate_forwards_with_mlx_lms_tokens(
    demo_hybrid, monkeypatch
):
    """The same steps where a runner does not fuse (`fuse=False`, as a distributed run's
    shards, or an architecture the proof fails on), on the hybrid demo: a forward per chunk
    and one for the decode rows, and every request's greedy tokens are still mlx-lm's own."""
    loaded = demo_hybrid
    runner = ModelRunner(loaded, fuse=False)
    counted = Counting(monkeypatch, runner)
    tokens = _mixed_steps(runner)
    calls = counted.take()
    assert "fused" not in calls
    assert calls[:3] == ["chunk"] * 3  # step 1: three chunks, three forwards
    for rid, prompt in PROMPTS.items():
        ours = [step[rid] for step in tokens if rid in step]
        assert ours == mlx_lm_greedy(loaded.model, prompt, len(ours)), rid


def test_the_warm_up_measures_both_kinds_of_mixed_step(demo, demo_hybrid):
    """The step-time model is seeded with a step whose decode row rides in its chunks'
    forward and one beside a decode forward built a step ahead; where the runner does not
    fuse, every mixed step has its decode forward apart."""
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4)
    for loaded, fuse, want in ((demo, True, [0, 1]), (demo_hybrid, False, [1, 1])):
        runner = ModelRunner(loaded, fuse=fuse)
        samples = measure_step_costs(runner, config, 300, loaded.max_context)
        mixed = [s.features for s in samples if s.features.decode_rows and s.features.has_prefill]
        assert sorted(f.separate_decode for f in mixed) == want, loaded.name
        assert runner.num_sequences == 0


def test_rows_of_very_different_lengths_decode_in_groups_with_their_own_tokens(demo):
    """A long prompt joining short decode rows decodes in a group of its own (one batch
    cache would pad every short row to its length, every step); a short request joining
    later goes in the short rows' group, in the middle of the batch, and a long one in the
    long one's; a row that leaves shrinks its group only, and one that retires leaves its
    own cache behind. Every step
    samples the logits one padded batch gives, and every request gets mlx-lm's tokens."""
    grouped = ModelRunner(demo, prefix_cache_bytes=1 << 28)
    unhurried = ModelRunner(demo, lookahead=False)  # samples every step's own logits
    one = ModelRunner(demo, fuse=False, lookahead=False)
    assert grouped.fuse
    sampled, sampled_in_one = _capture_sampled(unhurried), _capture_sampled(one)
    orders: list[tuple[list[str], list[str]]] = []  # each step's batch rows in each runner
    start = unhurried.sampler.start

    def spy(*a, **kw):
        orders.append((list(unhurried.batch.rows.ids), list(one.batch.rows.ids)))
        return start(*a, **kw)

    unhurried.sampler.start = spy
    prompts = {
        "a": prompt_ids(20, seed=21),
        "b": prompt_ids(9, seed=22),
        "long": prompt_ids(1500, seed=23),
        "c": prompt_ids(14, seed=24),
        "near": prompt_ids(1400, seed=25),
    }
    news = {rid: NewRequest(rid, tuple(p), GREEDY) for rid, p in prompts.items()}

    def chunk(rid: str, start: int, end: int) -> ScheduledChunk:
        return ScheduledChunk(rid, start, end, (), end == len(prompts[rid]))

    steps = [  # (decodes, chunks, admitted, freed)
        ((), (chunk("a", 0, 20), chunk("b", 0, 9)), ("a", "b"), ()),
        (("a", "b"), (chunk("long", 0, 800),), ("long",), ()),
        (("a", "b"), (chunk("long", 800, 1500),), (), ()),
        *[(("a", "b", "long"), (), (), ())] * 2,
        (("b", "long"), (chunk("c", 0, 14),), ("c",), ("a",)),
        (("b", "long", "c"), (chunk("near", 0, 1400),), ("near",), ()),
        *[(("b", "long", "c", "near"), (), (), ())] * 2,
        (("b", "c", "near"), (), (), ("long",)),
    ]
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    groups = []
    for i, (decodes, chunks, admit, free) in enumerate(steps):
        num = {rid: 1 for rid in decodes} | {c.request_id: c.num_tokens for c in chunks}
        plan = StepPlan(step=i + 1, decodes=decodes, chunks=chunks, num_scheduled_tokens=num)
        work = StepWork(
            plan=plan,
            admit=tuple(news[rid] for rid in admit),
            free=free,
            retire=frozenset(free),
        )
        got, want = grouped.run(work), one.run(work)
        assert not got.failed and got.tokens == want.tokens == unhurried.run(work).tokens
        for rid, token in got.tokens.items():
            tokens[rid].append(token)
        groups.append((list(grouped.batch.caches.sizes), list(grouped.batch.rows.ids)))
        grouped.look_ahead()
    assert groups[2] == ([2, 1], ["a", "b", "long"])  # long joined: a group of its own
    assert groups[5] == ([2, 1], ["b", "c", "long"])  # a left, c joined the short rows
    assert groups[6] == ([2, 2], ["b", "c", "long", "near"])  # near joined long's group
    assert groups[-1] == ([2, 1], ["b", "c", "near"])
    assert list(one.batch.caches.sizes) == [3]  # without fused steps: one batch, padded
    assert len(sampled) == len(sampled_in_one) == len(steps)
    for got_logits, want_logits, (order, want_order) in zip(
        sampled, sampled_in_one, orders, strict=True
    ):  # the final chunks' rows, then the batch's in each runner's row order
        finals = got_logits.shape[0] - len(order)
        rows = [*range(finals), *(finals + want_order.index(rid) for rid in order)]
        assert mx.allclose(got_logits, want_logits[mx.array(rows)], atol=1e-4)
    for rid, prompt in prompts.items():
        assert tokens[rid] == mlx_lm_greedy(demo.model, prompt, len(tokens[rid])), rid
    # long's retired cache (its prompt and the tokens its forwards took in) is exactly its own
    (fed,) = [t for t in grouped.store._entries if t[:1500] == tuple(prompts["long"])]
    assert list(fed[1500:]) == tokens["long"][: len(fed) - 1500]
    cache = grouped.store.get(fed, len(fed))
    nxt = mx.array([[7]])
    fresh = _prefilled(demo.model, list(fed))
    assert mx.allclose(demo.model(nxt, cache=cache), demo.model(nxt, cache=fresh), atol=1e-4)


def test_a_sliding_window_batch_in_groups_gives_every_request_its_own_tokens(demo_sliding):
    """On the sliding-window demo (16-token windows), rows of very different lengths join
    and leave decode groups beside fused chunks, every ring wrapped: each step's tokens are
    those of one padded batch without fusion, and every request's are mlx-lm's own."""
    grouped = ModelRunner(demo_sliding)
    one = ModelRunner(demo_sliding, fuse=False, lookahead=False)
    assert grouped.fuse
    prompts = {
        "a": prompt_ids(20, seed=21),
        "b": prompt_ids(9, seed=22),
        "long": prompt_ids(1500, seed=23),
        "c": prompt_ids(14, seed=24),
        "near": prompt_ids(1400, seed=25),
    }
    news = {rid: NewRequest(rid, tuple(p), GREEDY) for rid, p in prompts.items()}

    def chunk(rid: str, start: int, end: int) -> ScheduledChunk:
        return ScheduledChunk(rid, start, end, (), end == len(prompts[rid]))

    steps = [  # (decodes, chunks, admitted, freed)
        ((), (chunk("a", 0, 20), chunk("b", 0, 9)), ("a", "b"), ()),
        (("a", "b"), (chunk("long", 0, 800),), ("long",), ()),
        (("a", "b"), (chunk("long", 800, 1500),), (), ()),
        *[(("a", "b", "long"), (), (), ())] * 2,
        (("b", "long"), (chunk("c", 0, 14),), ("c",), ("a",)),
        (("b", "long", "c"), (chunk("near", 0, 1400),), ("near",), ()),
        *[(("b", "long", "c", "near"), (), (), ())] * 20,
        (("b", "c", "near"), (), (), ("long",)),
    ]
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    sizes = set()
    for i, (decodes, chunks, admit, free) in enumerate(steps):
        num = {rid: 1 for rid in decodes} | {c.request_id: c.num_tokens for c in chunks}
        plan = StepPlan(step=i + 1, decodes=decodes, chunks=chunks, num_scheduled_tokens=num)
        work = StepWork(plan=plan, admit=tuple(news[rid] for rid in admit), free=free)
        got, want = grouped.run(work), one.run(work)
        assert not got.failed and got.tokens == want.tokens, i
        for rid, token in got.tokens.items():
            tokens[rid].append(token)
        sizes.add(tuple(grouped.batch.caches.sizes))
        grouped.look_ahead()
    assert any(len(s) > 1 for s in sizes)  # the rows decoded in groups
    for rid, prompt in prompts.items():
        assert tokens[rid] == mlx_lm_greedy(demo_sliding.model, prompt, len(tokens[rid])), rid


def test_each_attention_wrapper_goes_on_a_module_once_whatever_the_order(demo):
    """The CPU attention and the fused step each wrap a model module's attention function
    once, however often runners are made and whichever wrapped it first; the fused step
    still finds mlx-lm's own function under the CPU one."""
    import importlib

    from stepline.engine import cpu_attention
    from stepline.engine.forward import wrappers

    module = importlib.import_module(type(demo.model).__module__)
    for _ in range(2):
        ModelRunner(demo)
        assert fused.install(module.__name__)
        cpu_attention.install(demo.model)
    found = wrappers(module.scaled_dot_product_attention)
    assert len(found) == len(set(found))  # none twice
    want = (
        {"stepline_fused", "stepline_cpu"} if mx.default_device() == mx.cpu else {"stepline_fused"}
    )
    assert set(found) == want


@pytest.fixture(scope="module")
def omni() -> LoadedModel:
    from stepline.engine.demo_files import OMNI_DEMO
    from stepline.engine.models import load_model

    loaded = load_model(OMNI_DEMO)
    step_module.forwards_kind(loaded.model, fuse=True, media=True)  # the wrappers installed
    return loaded


def test_a_media_chunk_in_a_fused_forward_gets_the_logits_and_cache_of_its_own_forward(omni):
    # An image's chunk on the omni demo's thinker: its rows enter as embeddings that are no
    # token's, at 3-D positions whose sections differ, with deepstack features added by the
    # first text layers; beside it a text chunk, each into a cache of its own.
    from stepline.engine import mrope
    from stepline.engine.forward import body_of, output_head

    model = omni.model
    inner = body_of(model)
    stacked = sum(isinstance(layer, mrope.Deepstack) for layer in inner.layers)
    assert stacked  # the thinker's vision tower feeds its first text layers
    prefix = mx.array([[1, 2, 3, 4, 5]])
    tokens, text = mx.array([30, 31, 32, 33]), mx.array([40, 41, 42])
    table = inner.embed_tokens(mx.array([[50, 51, 52, 53]]))
    embeddings = table[:, ::-1] * 0.7
    positions = mx.array([[5, 6, 6, 6], [5, 6, 6, 7], [5, 6, 7, 6]])
    deepstack = mx.stack([table * 0.2 * (i + 1) for i in range(stacked)])

    def cache() -> list:
        c = make_prompt_cache(model)
        inner(prefix, cache=c)
        return c

    own, other = cache(), cache()
    cached = mrope.positioned(own, positions, deepstack)
    want = output_head(model, inner(tokens[None], cache=cached, input_embeddings=embeddings))
    want_text = output_head(model, inner(text[None], cache=other))
    media = fused.Segment(
        tokens, cache(), positions=positions, embeddings=embeddings[0], deepstack=deepstack
    )
    plain = fused.Segment(text, cache(), positions=mx.arange(5, 8))
    got = fused.forward(model, [media, plain], [[0, 1, 2, 3], [0, 1, 2]])
    assert mx.allclose(got[0], want[0], atol=1e-4).item()
    assert mx.allclose(got[1], want_text[0], atol=1e-4).item()
    for mine, theirs in zip(media.cache, own, strict=True):  # the same keys and values stored
        assert mine.offset == theirs.offset == 9
        assert mx.allclose(mine.state[0], theirs.state[0], atol=1e-4).item()
    # and no wrong position passes: the same chunk at its first section only differs
    moved = fused.Segment(tokens, cache(), positions=positions[0], embeddings=embeddings[0])
    (wrong,) = fused.forward(model, [moved], [[0, 1, 2, 3]])
    assert not mx.allclose(wrong, want[0], atol=1e-4).item()


def test_a_model_whose_media_fusion_is_not_proven_runs_its_media_chunks_apart(omni, monkeypatch):
    assert step_module.forwards_kind(omni.model, fuse=True, media=True)[0].fuses_media
    body = fused.body  # a fused forward that drops the media rows' embeddings: not proven

    def dropping(model, segments):
        return body(model, [replace(s, embeddings=None, deepstack=None) for s in segments])

    monkeypatch.setattr(fused, "body", dropping)
    kind, _ = step_module.forwards_kind(omni.model, fuse=True, media=True)
    assert kind.fuses and not kind.fuses_media  # text chunks still fuse, media ones do not
