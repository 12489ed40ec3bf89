"""The online step-time model: what it recovers from measured steps, and what it ignores."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepline.actors.scheduler.cost_model import (
    MAX_TOKENS,
    MIN_SAMPLES,
    CostModel,
    Sample,
    StepCost,
    StepFeatures,
    chunk_attention,
    fit,
)

TRUE = StepCost(
    step=0.003,
    per_chunk=0.002,
    per_prefill_token=0.0004,
    per_attention=3e-8,
    per_decode_row=0.0015,
    per_decode_context=3e-8,  # a decode row's key is a query-key pair: `fit` ties them
    per_separate_decode=0.004,
)


def _random_step(rng: random.Random) -> StepFeatures:
    rows = rng.randint(0, 32)
    features = StepFeatures(
        decode_rows=rows, decode_context=sum(rng.randint(8, 4000) for _ in range(rows))
    )
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        features = features.with_chunk(rng.randint(0, 6000), rng.randint(1, 512))
    if features.decode_rows == 0 and not features.has_prefill:
        features = features.with_chunk(0, 64)
    if features.decode_rows and features.has_prefill:  # fused into the chunks' forward, or not
        features = replace(features, separate_decode=rng.randint(0, 1))
    return features


def _samples(n: int, seed: int, noise: float = 0.02) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        f = _random_step(rng)
        out.append(Sample(f, TRUE.predict(f) * (1 + rng.uniform(-noise, noise))))
    return out


def assert_close_coefficients(got: StepCost, want: StepCost, rel: float) -> None:
    for name, g, w in zip(
        ("step", "chunk", "token", "attention", "row", "context", "separate", "image", "audio"),
        got.coefficients(),
        want.coefficients(),
        strict=True,
    ):
        assert g == pytest.approx(w, rel=rel), name


def test_the_fit_recovers_known_coefficients_from_noisy_steps():
    assert_close_coefficients(fit(_samples(200, seed=0)), TRUE, rel=0.15)


def test_an_omni_models_image_and_audio_encoder_units_are_priced_apart():
    # an omni model's vision block over an image and audio layer over a clip cost what
    # their towers do: one price for both would over- or under-price every step of one
    true = replace(TRUE, per_encode_unit=0.020, per_audio_unit=0.005)
    rng = random.Random(3)
    samples = []
    for _ in range(120):
        f = _random_step(rng).with_encode(rng.randint(0, 3)).with_encode(rng.randint(0, 3), "audio")
        samples.append(Sample(f, true.predict(f) * (1 + rng.uniform(-0.02, 0.02))))
    got = fit(samples)
    assert got.per_encode_unit == pytest.approx(0.020, rel=0.15)
    assert got.per_audio_unit == pytest.approx(0.005, rel=0.15)
    assert got.per_unit("image") == got.per_encode_unit
    assert got.per_unit("audio") == got.per_audio_unit


# What SmolLM2's engine had measured as a burst of 16 chats began (its warm-up's steps and
# its first live ones): (chunks, prompt tokens, prompt attention pairs, decode rows, decode
# context, separate decode, seconds). Its decode steps took 0.20-0.22 s at 16 rows of ~400
# keys a few steps later.
SMOLLM2_BURST = [
    (1, 32, 528, 0, 0, 0, 0.187),
    (1, 64, 4128, 0, 0, 0, 0.291),
    (1, 128, 20544, 0, 0, 0, 0.541),
    (1, 256, 90240, 0, 0, 0, 1.289),
    (1, 1, 481, 0, 0, 0, 0.151),
    (0, 0, 0, 1, 482, 0, 0.241),
    (0, 0, 0, 1, 483, 0, 0.125),
    (3, 24, 108, 1, 18, 1, 0.203),
    (3, 24, 300, 1, 19, 0, 0.230),
    (0, 0, 0, 4, 80, 0, 0.268),
    (0, 0, 0, 4, 84, 0, 0.117),
    (0, 0, 0, 4, 88, 0, 0.118),
    (0, 0, 0, 1, 32, 0, 0.173),
    (0, 0, 0, 1, 33, 0, 0.098),
    (0, 0, 0, 1, 34, 0, 0.098),
    (1, 31, 496, 0, 0, 0, 0.219),
]


def test_decode_rows_at_a_context_no_decode_step_had_yet_are_priced_as_their_key_pairs():
    """Fitted apart from the prompt's attention, the decode context's price was whatever the
    few short decode steps left it: 16 rows of 400 keys priced at 0.64 s, and every step
    beside them let run 3x as long as the step-time floor means."""
    samples = [Sample(StepFeatures(*row[:6]), row[6]) for row in SMOLLM2_BURST]
    cost = fit(samples)
    assert cost.per_decode_context == cost.per_attention
    sixteen = StepFeatures(decode_rows=16, decode_context=16 * 400)
    assert 0.15 <= cost.predict(sixteen) <= 0.3


def test_the_fit_ignores_outliers():
    samples = _samples(200, seed=1)
    rng = random.Random(2)
    # one step in ten disturbed: a neighbour's burst of load, a pause of the process
    for i in rng.sample(range(len(samples)), 20):
        samples[i] = Sample(samples[i].features, samples[i].seconds * rng.uniform(3, 20))
    assert_close_coefficients(fit(samples), TRUE, rel=0.15)


def test_the_fit_never_returns_negative_coefficients():
    rng = random.Random(3)
    # times that a linear model cannot explain: the fit must stay non-negative anyway
    samples = [Sample(_random_step(rng), rng.uniform(0.001, 0.5)) for _ in range(100)]
    assert all(c >= 0 for c in fit(samples).coefficients())


def test_the_model_answers_only_once_it_has_enough_samples():
    model = CostModel(refit_every=1)
    samples = _samples(MIN_SAMPLES, seed=4)
    for s in samples[:-1]:
        model.observe(s.features, s.seconds)
        assert model.cost is None
    model.observe(samples[-1].features, samples[-1].seconds)
    assert model.cost is not None


def test_a_long_run_of_decode_steps_does_not_forget_what_prefill_costs():
    model = CostModel(window=32, refit_every=4)
    for s in _samples(64, seed=5):
        model.observe(s.features, s.seconds)
    rng = random.Random(6)
    for _ in range(500):  # decode-only steps, far more than the window
        f = StepFeatures(decode_rows=8, decode_context=8 * rng.randint(100, 2000))
        model.observe(f, TRUE.predict(f))
    cost = model.cost
    assert cost is not None
    chunk = StepFeatures().with_chunk(2000, 256)
    assert cost.predict(chunk) == pytest.approx(TRUE.predict(chunk), rel=0.2)


def test_the_model_follows_a_machine_that_slows_down():
    model = CostModel(window=64, refit_every=4, seed=_samples(16, seed=7))
    rng = random.Random(8)
    slower = StepCost(*(2 * c for c in TRUE.coefficients()))
    for _ in range(300):
        f = _random_step(rng)
        model.observe(f, slower.predict(f))
    step = StepFeatures(decode_rows=8, decode_context=8000).with_chunk(1000, 256)
    assert model.cost is not None
    assert model.cost.predict(step) == pytest.approx(slower.predict(step), rel=0.15)


def test_unusable_times_are_ignored():
    model, clean = CostModel(refit_every=1), CostModel(refit_every=1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(StepFeatures(decode_rows=1), bad)
        model.seed(StepFeatures(decode_rows=1), bad)
    assert model.cost is None and model.last is None
    for s in _samples(3 * MIN_SAMPLES, seed=5):
        model.observe(s.features, s.seconds)
        clean.observe(s.features, s.seconds)
    assert model.cost == clean.cost  # the fit of the usable times alone


def test_chunk_attention_counts_every_query_and_key_pair():
    # token i of the chunk [start, start + n) attends to start + i + 1 positions
    for start, n in [(0, 1), (0, 10), (100, 7), (4000, 512)]:
        assert chunk_attention(start, n) == sum(start + i + 1 for i in range(n))


@given(
    st.floats(0, 0.02),
    st.floats(0, 0.002),
    st.floats(0, 1e-6),
    st.integers(0, 100_000),
    st.floats(-0.1, 2.0),
)
def test_the_largest_chunk_that_fits_is_found_exactly(chunk, token, attention, start, seconds):
    cost = StepCost(per_chunk=chunk, per_prefill_token=token, per_attention=attention)
    n = cost.max_chunk_tokens(start, seconds)
    if seconds <= chunk:
        assert n == 0  # no time beyond a forward's fixed cost: no chunk
        return
    if n == MAX_TOKENS:
        return

    def cost_of(k: int) -> float:
        return cost.predict(StepFeatures().with_chunk(start, k))

    assert n == 0 or cost_of(n) <= seconds * (1 + 1e-12)
    assert cost_of(n + 1) > seconds * (1 - 1e-9)


@given(
    st.lists(st.floats(0, 1.0), min_size=7, max_size=7),
    st.lists(st.integers(0, 100_000), min_size=6, max_size=6),
)
def test_a_prediction_prices_every_feature_by_its_coefficient(coefficients, amounts):
    cost = StepCost(*coefficients)
    features = StepFeatures(*amounts)
    priced = sum(c * x for c, x in zip(cost.coefficients(), features.vector(), strict=True))
    assert cost.predict(features) == pytest.approx(priced, rel=1e-12, abs=1e-12)


def test_coefficients_must_be_non_negative():
    with pytest.raises(ValueError, match="per_attention"):
        StepCost(per_attention=-1e-9)
    with pytest.raises(ValueError, match="step"):
        StepCost(step=float("nan"))


def test_the_small_late_chunks_of_a_long_prompt_do_not_hide_what_a_big_early_chunk_costs():
    """Real steps are not exactly linear (a small chunk uses the machine less well); a long
    prompt's hundreds of small late chunks must not push its first big chunks out of the
    fit, or the next long prompt's first chunk runs far over its time."""

    def measured(f: StepFeatures) -> float:
        small_chunk_penalty = 1 + 16 / max(f.prefill_tokens, 1)  # per prompt token
        return TRUE.predict(f) + TRUE.per_prefill_token * f.prefill_tokens * (
            small_chunk_penalty - 1
        )

    model = CostModel(window=64, refit_every=4)
    rng = random.Random(9)
    for start in range(0, 2048, 256):  # the prompt's big early chunks, beside 4 decode rows
        f = StepFeatures(decode_rows=4, decode_context=400).with_chunk(start, 256)
        model.observe(f, measured(f))
    for _ in range(400):  # then small chunks deep into the prompt
        f = StepFeatures(decode_rows=4, decode_context=400).with_chunk(rng.randint(4000, 6000), 8)
        model.observe(f, measured(f))
    early = StepFeatures(decode_rows=4, decode_context=400).with_chunk(0, 256)
    assert model.cost is not None
    assert model.cost.predict(early) == pytest.approx(measured(early), rel=0.15)


def test_the_first_live_steps_override_an_optimistic_warm_up():
    """The warm-up runs alone and measures faster steps than a loaded engine takes (17 ms
    against 30-35 ms for a decode step of stepline-demo-large on 2 cores). After a few live
    steps the model must predict what they took, or the first steps of a long prompt under
    load run far over their time."""
    steps = [_random_step(random.Random(i)) for i in range(16)]
    seeds = [Sample(f, TRUE.predict(f)) for f in steps]
    loaded = StepCost(*(2 * c for c in TRUE.coefficients()))
    decode = StepFeatures(decode_rows=4, decode_context=4 * 40)
    first_chunk = decode.with_chunk(0, 256)  # a kind of step not seen live yet

    def run(model: CostModel, live: list[StepFeatures]) -> StepCost:
        for f in live:
            model.observe(f, loaded.predict(f))
        assert model.cost is not None
        return model.cost

    model = CostModel(seed=seeds)  # the defaults: refit every 16 steps once warmed up
    assert model.cost is not None
    assert model.cost.predict(decode) == pytest.approx(TRUE.predict(decode), rel=0.15)
    # A few live prefill steps (the decoders' own prompts), then decode steps.
    prompts = [StepFeatures().with_chunk(0, 32).with_chunk(0, 32) for _ in range(6)]
    cost = run(model, prompts + [decode] * MIN_SAMPLES)
    assert cost.predict(decode) == pytest.approx(loaded.predict(decode), rel=0.15)
    # The first chunk is priced as much slower as the live prefill steps were.
    assert cost.predict(first_chunk) == pytest.approx(loaded.predict(first_chunk), rel=0.2)

    # Decode steps alone do not set that scale: what slows them down live is mostly host
    # work that a chunk does not share.
    cost = run(CostModel(seed=seeds), [decode] * MIN_SAMPLES)
    chunk_share = cost.predict(first_chunk) - cost.predict(decode)
    assert chunk_share == pytest.approx(TRUE.predict(first_chunk) - TRUE.predict(decode), rel=0.2)


def test_one_slow_live_prefill_step_does_not_make_every_chunk_look_dear():
    """A lone prefill step slowed 5x (a pause) must not set the warm-up's scale on its own:
    it counts for the square root of its word until more prefill steps say the same."""
    seeds = [
        Sample(f, TRUE.predict(f)) for f in (_random_step(random.Random(i)) for i in range(16))
    ]
    model = CostModel(seed=seeds)
    paused = StepFeatures().with_chunk(0, 32).with_chunk(0, 32)
    model.observe(paused, 5 * TRUE.predict(paused))
    rng = random.Random(11)
    for _ in range(100):
        f = StepFeatures(decode_rows=4, decode_context=4 * rng.randint(40, 400))
        model.observe(f, TRUE.predict(f))
    chunk = StepFeatures().with_chunk(0, 512)
    assert model.cost is not None
    assert model.cost.predict(chunk) < 2.5 * TRUE.predict(chunk)


def test_a_step_whose_decode_rows_ride_in_its_chunks_forward_is_predicted_cheaper():
    """Fused steps (one forward) and steps whose decode rows ran in a forward of their own
    beside the same chunks: the fit tells them apart by what the second forward costs."""
    model = CostModel(window=64, refit_every=1)
    for s in _samples(120, seed=11):
        model.observe(s.features, s.seconds)
    cost = model.cost
    assert cost is not None
    fused = StepFeatures(decode_rows=4, decode_context=800).with_chunk(300, 64)
    apart = replace(fused, separate_decode=1)
    assert cost.predict(apart) - cost.predict(fused) == pytest.approx(0.004, rel=0.2)
    assert cost.predict(fused) == pytest.approx(TRUE.predict(fused), rel=0.1)


def test_a_chunk_much_dearer_than_priced_makes_the_next_one_smaller_at_once():
    """Deep into a long prompt, a chunk's attention can cost what no sample showed (a first
    start whose warm-up was cut short). The next step must not repeat the mistake while the
    robust fit is slow to learn it; a step that costs what the fit says ends the correction,
    and so does a step without prefill."""
    model = CostModel(seed=_samples(40, seed=3))
    assert model.cost is not None
    deep = StepFeatures(decode_rows=4, decode_context=4 * 300).with_chunk(1500, 120)
    priced, prompt = model.cost.predict(deep), model.cost.prompt_part(deep)
    took = priced + 2 * prompt  # its prompt work took 3x its price
    model.observe(deep, took)
    cost = model.cost
    assert cost is not None
    assert cost.predict(deep) == pytest.approx(took, rel=0.15)
    fixed = priced - prompt
    assert fixed + cost.prompt_part(StepFeatures().with_chunk(1620, 60)) > priced
    # ... so the chunk that fits the time the last one was priced at is much smaller
    assert cost.max_chunk_tokens(1620, prompt) < 0.6 * 120

    model.observe(deep, priced)  # as the fit says, this time
    assert model.cost is not None
    assert model.cost.predict(deep) < priced + prompt
    model.observe(deep, took)
    model.observe(StepFeatures(decode_rows=4, decode_context=1200), 0.01)
    assert model.cost is not None
    assert model.cost.predict(deep) < 0.8 * took  # the fit has learned some, not all of it


def test_the_warm_ups_price_of_an_image_encoder_stands_while_live_prompts_fill_the_bands():
    """A vision model's warm-up measures its encoder's units; live, the streams' own prompts
    fill the prefill windows long before an image arrives. The encoder's samples must not be
    pushed out with them: priced at nothing, an image's encoder ran whole in one step (62 s
    on SmolVLM-256M's shape, every stream stalled)."""
    true = replace(TRUE, per_encode_unit=0.4)
    decode = StepFeatures(decode_rows=4, decode_context=4 * 40)
    seeds = [
        Sample(f, true.predict(f)) for f in (_random_step(random.Random(i)) for i in range(16))
    ]
    seeds += [Sample(decode.with_encode(k), true.predict(decode.with_encode(k))) for k in (1, 2, 3)]
    model = CostModel(seed=seeds)
    prompts = [StepFeatures(decode_rows=4, decode_context=160).with_chunk(0, 64)] * 40
    for f in prompts + [decode] * 40:
        model.observe(f, true.predict(f))
    assert model.cost is not None
    assert model.cost.per_encode_unit == pytest.approx(0.4, rel=0.2)
