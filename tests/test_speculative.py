"""Speculative decoding (actors/scheduler/drafter.py): drafts from a request's own tokens, verified
in the step, the same greedy tokens as without them, and fewer steps where output copies."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from core_driver import LIMITS, make_core, params
from families import FAMILIES, model_dir
from helpers import mlx_lm_greedy
from mlx_lm.models.cache import ChunkedKVCache, KVCache, make_prompt_cache

from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.drafter import (
    ENTER_MATCH,
    MAX_ENTRIES,
    SOLO_PATIENCE,
    WINDOW,
    Drafter,
    SpeculativeConfig,
    accept,
    parse_speculative_config,
)
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.work import StepResult
from stepline.api import Engine, SamplingParams
from stepline.api.cli import main
from stepline.api.config import EngineConfig
from stepline.api.reexecute import reexecute
from stepline.engine.draft_model import DraftModel
from stepline.engine.models import DEMO_MODELS, demo_model_path, load_model
from stepline.engine.rollback import Held
from stepline.engine.sampling import RowSampling, Sampler
from stepline.engine.sequences import Seq
from stepline.engine.verify import Verify, check_speculation, verify_rows
from stepline.events.log import read_events
from stepline.events.models import RequestParams, StepPlanned, TokensSampled
from stepline.events.replay.summary import request_why, summarize

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
NGRAM_JSON = '{"method": "ngram", "num_speculative_tokens": 4}'

# -- the config ---------------------------------------------------------------------------


def test_the_config_reads_vllms_shape_and_says_what_is_wrong():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
    )
    assert parse_speculative_config(None) is None
    with pytest.raises(ValueError, match="'eagle' is not supported"):
        parse_speculative_config('{"method": "eagle", "model": "x"}')
    with pytest.raises(ValueError, match="not JSON"):
        parse_speculative_config("{method: ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse_speculative_config('{"method": "ngram"}')
    with pytest.raises(ValueError, match="must not exceed"):
        parse_speculative_config(
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}'
        )
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}')
    assert EngineConfig(speculative_config=NGRAM_JSON).speculative_config == NGRAM


# -- drafting and accepting ---------------------------------------------------------------


def test_a_drafter_proposes_what_followed_the_latest_earlier_occurrence_of_its_suffix():
    drafter = Drafter(NGRAM, [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8])
    assert drafter.lookup() == ()  # "7 8" occurred nowhere before
    drafter.extend([9, 2, 3])
    # "9 2 3" last occurred at 6-8 (followed by 7 8 9 2), over "2 3" at 1-2 (followed by 4)
    assert drafter.lookup() == (7, 8, 9, 2)
    # a row in the decode batch starts drafting only once a copy has begun: a longer match
    assert ENTER_MATCH == 4 and drafter.propose() is None
    drafter.extend([7])
    assert drafter.propose() == (8, 9, 2, 3)  # "9 2 3 7" occurred before


def test_k_grows_after_full_acceptance_and_falls_to_what_was_kept():
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=6), [1])
    drafter.k = 3
    drafter.observe(3, 3)
    assert drafter.k == 4
    drafter.observe(4, 1)
    assert drafter.k == 2
    drafter.observe(2, 0)
    assert drafter.k == 1


def test_a_drafting_row_that_finds_nothing_goes_back_to_the_batch_and_may_come_again():
    drafter = Drafter(NGRAM, [5, 6, 7, 8, 9, 5, 6, 7, 8])
    for _ in range(MAX_ENTRIES):
        drafts = drafter.propose()
        assert drafts == (9, 5, 6, 7)
        drafter.planned(drafts)  # drafting on its own cache
        assert drafter.solo
        for _ in range(SOLO_PATIENCE):
            drafter.planned(())  # kept drafting, nothing found (or fit) this step
            drafter.observe(0, 0)
            assert drafter.solo
        assert drafter.propose() is None  # back to the batch
        drafter.planned(None)
        assert not drafter.solo
    assert drafter.propose() is None  # it left the batch MAX_ENTRIES times: no more
    assert drafter.lookup() == (9, 5, 6, 7)


def test_a_batch_row_given_no_drafts_stays_in_the_batch():
    drafter = Drafter(NGRAM, [5, 6, 7, 8, 9, 5, 6, 7, 8])
    drafter.planned(())  # proposed, none fit the budget
    assert not drafter.solo


def test_a_request_whose_drafts_are_rejected_stops_drafting_for_good():
    wrong = Drafter(NGRAM, [1, 2, 3, 4, 1, 2, 3, 4])
    wrong.planned(wrong.propose())
    for _ in range(WINDOW):
        wrong.observe(2, 0)
    assert not wrong.active and wrong.propose() is None


def test_greedy_acceptance_keeps_the_agreeing_drafts_and_the_targets_next_token():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept([], [4]) == [4]


# Critical value of chi-square with 4 degrees of freedom at p = 0.001.
CHI2_4_999 = 18.47


def _chi2(counts: Counter, probs: list[float]) -> float:
    n = sum(counts.values())
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(probs))


@pytest.mark.parametrize("seeded", [True, False])
def test_drafted_tokens_are_draws_from_the_models_own_distribution(seeded: bool):
    """On a vocabulary of 5, 4,000 rows drafting (1, 0) against fixed logits: the first
    token, the second where the first draft was kept, and the third where both were, each
    follow the model's distribution at its place (chi-square, 4 degrees of freedom),
    whichever drafts were kept."""
    probs = [[0.1, 0.4, 0.2, 0.2, 0.1], [0.3, 0.1, 0.3, 0.2, 0.1], [0.05, 0.15, 0.2, 0.25, 0.35]]
    logits = mx.log(mx.array(probs))
    verifies = []
    for i in range(4000):
        sampling = RowSampling(temperature=1.0, seed=i if seeded else None)
        request = RequestParams(
            max_tokens=8, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=sampling.seed
        )
        seq = Seq(f"r{i}", mx.array([0]), sampling, None, None, request)
        verifies.append(Verify(seq, (1, 0), logits))

    def fail(request_id: str, what: str, exc: BaseException) -> None:
        raise AssertionError(what) from exc

    kept = verify_rows(None, Sampler(seed=7), verifies, [], {}, {}, fail)
    outputs = [v.seq.output for v in verifies]
    assert all(
        len(o) == len(kept[v.seq.request_id]) + 1 for o, v in zip(outputs, verifies, strict=True)
    )
    first = Counter(o[0] for o in outputs)
    second = Counter(o[1] for o in outputs if o[0] == 1)
    third = Counter(o[2] for o in outputs if o[:2] == [1, 0])
    assert 1400 < sum(second.values()) < 1800  # the first draft kept as often as drawn (0.4)
    for counts, p in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        assert _chi2(counts, p) < CHI2_4_999, (counts, p)
    # what a biased verifier (one keeping every draft) would show fails the same check
    assert _chi2(Counter({1: 4000}), probs[0]) > CHI2_4_999


# -- the scheduler ------------------------------------------------------------------------


def _decoding_core(config: SchedulerConfig, cost: StepCost | None = None, max_tokens: int = 64):
    """A core with request r0 decoding (its first token 1) after a prompt that repeats, so
    that it drafts: its tokens end "15 16 17 18 11", last seen followed by "12 13 14 15"
    (token 2 is the end of sequence)."""
    core = make_core(config=config, cost=cost, speculative=NGRAM, limits=LIMITS)
    core.add("r0", list(range(11, 19)) * 4, params(max_tokens=max_tokens))
    while core.states["r0"].num_output_tokens == 0:
        work = core.schedule()
        assert work is not None and not work.plan.drafts
        final = any(c.is_final for c in work.plan.chunks)
        core.update_from_output(work, StepResult(tokens={"r0": 11} if final else {}))
    return core


def test_drafts_take_what_the_budget_leaves_after_every_decode_rows_token():
    core = _decoding_core(SchedulerConfig(max_step_tokens=3, max_num_seqs=2, max_step_ms=None))
    plan = core.schedule().plan
    assert plan.decodes == ("r0",)
    assert plan.drafts == {"r0": (12, 13)}  # 4 proposed, 2 fit beside its own token
    assert plan.num_scheduled_tokens == {"r0": 3}


def test_drafts_stop_at_the_tokens_a_request_may_still_make():
    core = _decoding_core(SchedulerConfig(max_step_tokens=64, max_step_ms=None), max_tokens=3)
    assert core.schedule().plan.drafts == {"r0": (12,)}  # 1 made, its own token, then 1 draft


def test_drafts_are_cut_to_the_time_target_by_the_cost_model():
    # 1 ms a step, 0.5 ms a decode row, 30 ms a drafted token: under 100 ms, 3 drafts
    cost = StepCost(step=0.001, per_decode_row=0.0005, per_prefill_token=0.03)
    core = _decoding_core(SchedulerConfig(max_step_tokens=64, max_step_ms=100), cost)
    assert core.schedule().plan.drafts == {"r0": (12, 13, 14)}


def test_kept_drafts_are_rows_of_the_decoding_event_and_a_stop_token_ends_them():
    core = _decoding_core(SchedulerConfig(max_step_tokens=64, max_step_ms=None))
    work = core.schedule()
    assert work.plan.drafts == {"r0": (12, 13, 14, 15)}
    out = core.update_from_output(
        work, StepResult(tokens={"r0": 9}, drafted={"r0": (12, 13, 14)})
    )  # 3 kept, then the target's own token
    assert out.updates["r0"].token_ids == [12, 13, 14, 9]
    assert core.states["r0"].num_output_tokens == 5
    event = [e for e in core.take_events() if isinstance(e, TokensSampled)][-1]
    assert event.request_ids == ("r0",) * 4 and event.token_ids == (12, 13, 14, 9)

    work = core.schedule()
    out = core.update_from_output(work, StepResult(tokens={"r0": 6}, drafted={"r0": (2, 2)}))
    assert out.updates["r0"].token_ids == [2]  # EOS (2) ends it: nothing after is kept
    assert out.updates["r0"].finish is not None and "r0" not in core.states


# -- the engine ---------------------------------------------------------------------------

# Prompts a random-weight demo continues by repeating itself: drafts are kept.
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18] * 6,
    [21, 22, 23] * 12 + [24, 25],
    list(range(30, 90)),
    [40, 41, 42, 43] * 9,
]


GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


async def _generate(
    spec: str | None,
    log: Path | None = None,
    params: Callable[[int], SamplingParams] = lambda i: GREEDY,
    model: str = "stepline-demo",
    **kw,
) -> list[list[int]]:
    """Each of `PROMPTS` sent together, request i with `params(i)`, on stepline-demo with
    `spec` as its speculative config; their tokens."""
    options = {"max_step_tokens": 40, "max_num_seqs": 8, "max_step_ms": None, **kw}
    if spec is not None:
        options["speculative_config"] = spec
    if log is not None:
        options["event_log"] = str(log)
    out: list[list[int]] = [[] for _ in PROMPTS]
    async with Engine.open(model, **options) as engine:

        async def one(i: int) -> None:
            async for o in engine.generate(PROMPTS[i], params=params(i), request_id=f"r{i}"):
                out[i].extend(o.token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
    return out


async def test_batched_chunked_greedy_output_is_the_same_with_drafts_and_takes_fewer_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    plain = await _generate(None, tmp_path / "plain.jsonl")
    drafted = await _generate(NGRAM_JSON, tmp_path / "drafted.jsonl")
    assert drafted == plain
    assert all(len(o) == 48 for o in drafted)

    events = list(read_events(tmp_path / "drafted.jsonl"))
    kept = Counter()
    for e in events:
        if isinstance(e, TokensSampled):
            for rid, n in Counter(e.request_ids).items():
                kept[rid] += n - 1
    assert sum(kept.values()) >= 24  # drafts were kept: fewer steps made the same tokens
    proposed = sum(
        n - 1
        for e in events
        if isinstance(e, StepPlanned)
        for n, kind in zip(e.num_tokens, e.kinds, strict=True)
        if kind == "decode"
    )
    assert proposed >= sum(kept.values())
    # prompts were chunked beside drafting rows, every step within the budget
    plans = [e for e in events if isinstance(e, StepPlanned)]
    assert any("prefill" in p.kinds and "decode" in p.kinds for p in plans)
    assert all(sum(p.num_tokens) <= 40 for p in plans)

    def steps_of(rid: str, events) -> int:
        return sum(isinstance(e, TokensSampled) and rid in e.request_ids for e in events)

    plain_events = list(read_events(tmp_path / "plain.jsonl"))
    assert steps_of("r0", events) <= steps_of("r0", plain_events) - kept["r0"]
    assert kept["r0"] > 0

    # replay says it: over the run and for one request, the figures the log holds
    drafts = summarize(tmp_path / "drafted.jsonl").drafts
    assert drafts is not None
    assert (drafts.num_proposed, drafts.num_accepted) == (proposed, sum(kept.values()))
    assert summarize(tmp_path / "plain.jsonl").drafts is None
    why = request_why(tmp_path / "drafted.jsonl", "r0")
    assert why.num_kept == kept["r0"]
    assert main(["replay", str(tmp_path / "drafted.jsonl"), "--request", "r0"]) == 0
    assert f"{kept['r0']} kept" in capsys.readouterr().out
    # re-execution drafts again (the header holds the config) and makes the same tokens
    again = await reexecute(tmp_path / "drafted.jsonl")
    assert (again.num_same, again.num_diverged) == (len(PROMPTS), 0)


async def test_a_drafted_request_ends_at_max_tokens_and_at_its_stop_token_exactly():
    plain = await _generate(None, max_step_tokens=64)
    stop = plain[0][20]
    for spec in (None, NGRAM_JSON):
        options = {"max_step_tokens": 64, "max_step_ms": None}
        if spec:
            options["speculative_config"] = spec
        async with Engine.open("stepline-demo", **options) as engine:
            p = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
            short = [t async for o in engine.generate(PROMPTS[0], params=p) for t in o.token_ids]
            p = SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[stop])
            outs = [o async for o in engine.generate(PROMPTS[0], params=p)]
        assert short == plain[0][:7]
        tokens = [t for o in outs for t in o.token_ids]
        assert tokens == plain[0][: plain[0].index(stop) + 1]
        assert outs[-1].finish_reason == "stop"


def test_a_model_whose_caches_cannot_be_taken_back_is_refused_with_a_reason():
    """A chunked KV cache (Llama 4's) is no kind `Held` takes tokens back out of."""

    class Chunked:  # a model that makes mlx-lm's chunked cache
        def make_cache(self) -> list:
            return [ChunkedKVCache(8), KVCache()]

    with pytest.raises(ValueError, match="ChunkedKVCache layers"):
        check_speculation(Chunked())


async def test_a_sliding_window_model_drafts_past_its_window_with_the_same_tokens(
    tmp_path: Path,
):
    """A Gemma-3-shaped model whose sliding window is 40 tokens, drafted for by another
    (random weights: most drafts rejected, so taken back out of both models' rings, wrapped
    or not) and by itself (every draft kept): requests draft inside the window and past it,
    and every request's greedy tokens are mlx-lm's own, as without drafts."""
    family = next(f for f in FAMILIES if f.module == "gemma3_text")
    served = str(model_dir(family, tmp_path / "served", sliding_window=40))
    other = str(model_dir(family, tmp_path / "other", seed=8, sliding_window=40))
    plain = await _generate(None, model=served)
    reference = load_model(served).model
    for prompt, tokens in zip(PROMPTS, plain, strict=True):
        assert tokens == mlx_lm_greedy(reference, prompt, 48)
    for draft in (other, served):
        log = tmp_path / f"{Path(draft).name}.jsonl"
        assert await _generate(_draft_config(draft, k=3), log, model=served) == plain
        drafting = _drafting_rows(log)
        assert min(held + n for held, n in drafting) <= 40  # inside the window
        assert max(held + n for held, n in drafting) > 40  # and past it


def _drafting_rows(log: Path) -> list[tuple[int, int]]:
    """(the tokens its request held, its drafts) of every drafting row in `log`'s plans."""
    held = {f"r{i}": len(p) for i, p in enumerate(PROMPTS)}
    rows = []
    for e in read_events(log):
        if isinstance(e, TokensSampled):
            for rid in e.request_ids:
                held[rid] += 1
        elif isinstance(e, StepPlanned):
            for rid, n, kind in zip(e.request_ids, e.num_tokens, e.kinds, strict=True):
                if kind == "decode" and n > 1:
                    rows.append((held[rid], n - 1))
    return rows


async def test_seeded_sampled_output_is_the_same_with_drafts_token_for_token(tmp_path: Path):
    """A seeded draw's randomness is keyed by (seed, place in the output): each drafted place
    picks what the row would have drawn there without drafts, so the output is the same."""
    seeded = {
        "temperature": 0.02,  # the demo's random weights: near its greedy loops
        "top_p": 0.95,
        "max_tokens": 40,
        "ignore_eos": True,
    }

    def params(i: int) -> SamplingParams:
        return SamplingParams(seed=100 + i, **seeded)

    plain = await _generate(None, tmp_path / "plain.jsonl", params)
    assert await _generate(NGRAM_JSON, tmp_path / "drafted.jsonl", params) == plain
    drafts = summarize(tmp_path / "drafted.jsonl").drafts
    assert drafts is not None and drafts.num_accepted > 0  # drafted places were kept


# -- a draft model ------------------------------------------------------------------------


def _draft_config(model: str, k: int = 4) -> str:
    return f'{{"method": "draft_model", "model": "{model}", "num_speculative_tokens": {k}}}'


async def test_a_draft_model_drafts_and_greedy_output_is_the_same(tmp_path: Path):
    """stepline-demo drafting for stepline-demo-large (the demos share a tokenizer), batched
    and chunked: the same tokens as without drafts; and the model drafting for itself has
    every draft kept (its drafts are the served model's own greedy tokens)."""
    large = "stepline-demo-large"
    plain = await _generate(None, model=large)
    drafted = await _generate(_draft_config("stepline-demo"), tmp_path / "large.jsonl", model=large)
    assert drafted == plain
    drafts = summarize(tmp_path / "large.jsonl").drafts
    assert drafts is not None and drafts.num_proposed > 0
    again = await reexecute(tmp_path / "large.jsonl")  # the header names the draft model
    assert (again.num_same, again.num_diverged) == (len(PROMPTS), 0)

    own = await _generate(_draft_config("stepline-demo", k=3), tmp_path / "own.jsonl")
    assert own == await _generate(None)
    drafts = summarize(tmp_path / "own.jsonl").drafts
    assert drafts is not None and drafts.num_accepted > 0
    assert drafts.num_accepted == drafts.num_proposed  # it drafted what it then made


async def test_a_draft_model_that_reads_other_tokens_is_refused_with_a_reason(smollm2):
    with pytest.raises(ValueError, match="does not share"):
        async with Engine.open("stepline-demo", speculative_config=_draft_config(smollm2.name)):
            pass
    with pytest.raises(ValueError, match="draft_model"):
        parse_speculative_config('{"method": "draft_model", "num_speculative_tokens": 2}')


@pytest.mark.parametrize("spec", [NGRAM_JSON, _draft_config("stepline-demo", k=3)])
async def test_drafts_where_steps_do_not_fuse_give_the_same_tokens(
    spec: str, monkeypatch: pytest.MonkeyPatch
):
    """A model whose steps do not fuse (an architecture `engine/fused.py` does not cover)
    builds the batch's forward a step ahead every step: rows leave and rejoin the batch
    after a step instead of before it."""
    from stepline.engine import fused

    plain = await _generate(None)

    def never_fuses(model, kv=None):  # a proof (`forward.Proof`) that says no at once
        return False
        yield

    monkeypatch.setattr(fused, "fused_forward_proof", never_fuses)
    assert await _generate(spec) == plain


# -- models whose caches are not all plain KV -----------------------------------------------


def _looping_demo(name: str, out: Path) -> str:
    """Demo `name` (a hybrid, a sliding window) with weights small enough that its greedy
    decoding falls into loops now and then, as stepline-demo's does: prompt lookup then
    drafts, some kept and some rejected."""
    spec = dataclasses.replace(DEMO_MODELS[name], init_std=0.015)
    DEMO_MODELS[f"{name}-loops"] = spec
    try:
        return str(demo_model_path(f"{name}-loops", cache_dir=out))
    finally:
        del DEMO_MODELS[f"{name}-loops"]


def _family(module: str, out: Path) -> str:
    return str(model_dir(next(f for f in FAMILIES if f.module == module), out))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda out: _looping_demo("stepline-demo-hybrid", out), id="qwen3-next"),
        pytest.param(lambda out: _looping_demo("stepline-demo-sliding", out), id="gemma3"),
        pytest.param(lambda out: _family("lfm2", out / "lfm2"), id="lfm2"),
        pytest.param(lambda out: _family("gpt_oss", out / "gpt-oss"), id="gpt-oss"),
    ],
)
async def test_hybrid_and_sliding_window_models_draft_with_the_same_tokens(
    build: Callable[[Path], str], tmp_path: Path
):
    """A Gated DeltaNet hybrid, a short-convolution hybrid and two sliding-window models (a
    16-token window, so past it at once), four requests at once, greedy and seeded: with
    n-gram drafts, each makes exactly the tokens it makes without, while steps keep drafts
    and reject others (the recurrent state and the wrapped rings put back and run again)."""
    model = build(tmp_path)

    def params(i: int) -> SamplingParams:
        if i % 2 == 0:
            return GREEDY
        return SamplingParams(
            max_tokens=48, temperature=0.02, top_p=0.95, seed=100 + i, ignore_eos=True
        )

    plain = await _generate(None, params=params, model=model)
    drafted = await _generate(NGRAM_JSON, tmp_path / "drafted.jsonl", params, model=model)
    assert drafted == plain
    kept_all, rejected = _drafting_steps(tmp_path / "drafted.jsonl")
    assert kept_all > 0 and rejected > 0


def _drafting_steps(log: Path, max_tokens: int = 48) -> tuple[int, int]:
    """(drafting rows that kept every draft, those that rejected one) in `log`, not counting
    a row whose request ended at that step (its drafts cut by `max_tokens`)."""
    planned: dict[int, dict[str, int]] = {}
    made: Counter[str] = Counter()
    kept_all = rejected = 0
    for e in read_events(log):
        if isinstance(e, StepPlanned):
            planned[e.step] = {
                rid: n
                for rid, n, kind in zip(e.request_ids, e.num_tokens, e.kinds, strict=True)
                if kind == "decode" and n > 1
            }
        elif isinstance(e, TokensSampled):
            counts = Counter(e.request_ids)
            made.update(counts)
            for rid, n in planned.get(e.step, {}).items():
                if counts[rid] == n:
                    kept_all += 1
                elif made[rid] < max_tokens:
                    rejected += 1
    return kept_all, rejected


@pytest.mark.parametrize("name", ["stepline-demo-hybrid", "stepline-demo-sliding"])
def test_a_held_cache_takes_tokens_back_on_every_kind(name: str):
    """A hybrid's recurrent and attention layers, and a sliding window's ring past its
    window: a cache held before 5 tokens, 3 of them taken back (and the 2 kept run again,
    as it says), gives the next token the logits of a cache that took only those 2."""
    model = load_model(name).model
    prompt = mx.array([list(range(30, 70))])  # past the 16-token window
    more, tried = mx.array([[7, 8]]), mx.array([[7, 8, 9, 10, 11]])

    def fed(*parts: mx.array) -> list:
        cache = make_prompt_cache(model)
        for part in parts:
            model(part, cache=cache)
        return cache

    want = model(mx.array([[12]]), cache=fed(prompt, more))
    cache = fed(prompt)
    held = Held(cache, 5)
    assert not held.trims  # recurrent state; a ring the tokens wrap
    model(tried, cache=cache)
    assert held.take_back(3)
    model(more, cache=cache)
    got = model(mx.array([[12]]), cache=cache)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_recurrent_draft_model_drafts_after_rejections_as_a_fresh_one_would():
    """A hybrid draft model whose drafts were rejected (its state put back, the kept tokens
    fed at its next draft) drafts what a draft model that never saw them drafts."""
    hybrid = load_model("stepline-demo-hybrid").model

    def seq(tokens: list[int]) -> Seq:
        request = RequestParams(
            max_tokens=64, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None
        )
        s = Seq("r", mx.array(tokens[:20]), RowSampling(temperature=0.0), None, None, request)
        s.output.extend(tokens[20:])
        return s

    prompt = list(range(40, 60)) + [61]
    drafting = DraftModel(hybrid)
    row = seq(prompt)
    drafts = drafting.propose(row, 4)
    assert len(drafts) == 4
    target = (drafts[1] + 1) % 1000  # the first draft kept, then the served model's own
    row.output.extend([drafts[0], target])
    drafting.trim(row)
    fresh = DraftModel(hybrid).propose(seq([*prompt, drafts[0], target]), 3)
    assert drafting.propose(row, 3) == fresh
