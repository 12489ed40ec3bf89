"""Batched per-request sampling: greedy, temperature, filters, seeds, penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from stepline.engine import sampling
from stepline.engine.penalties import apply_penalties
from stepline.engine.sampling import RowHistory, RowSampling, Sampler, SamplingRows

import mlx.core as mx  # isort: skip  # after stepline.engine, which loads OpenBLAS first


def probs_of(logits: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    return [w / sum(weights) for w in weights]


def draw_many(logits: list[float], row: RowSampling, n: int = 4000, seed: int = 0) -> Counter:
    """n independent draws of one row, as one batch of n identical rows."""
    batch = mx.array([logits] * n)
    out = Sampler(seed=seed).sample(batch, [row] * n, positions=[0] * n)
    return Counter(out.tokens)


def assert_frequencies_match(counts: Counter, expected: list[float], tolerance: float) -> None:
    n = sum(counts.values())
    for token, p in enumerate(expected):
        assert abs(counts[token] / n - p) < tolerance, (token, counts[token] / n, p)


def random_logits(rows: int, vocab: int, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 3


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax():
    logits = random_logits(8, 500)
    out = Sampler().sample(logits, [RowSampling(temperature=0)] * 8, positions=[0] * 8)
    assert out.tokens == mx.argmax(logits, axis=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_among_sampled_rows_still_take_the_argmax():
    logits = random_logits(6, 500)
    rows = [RowSampling(temperature=0), RowSampling(temperature=1.0, top_p=0.5)] * 3
    out = Sampler().sample(logits, rows, positions=[0] * 6)
    argmax = mx.argmax(logits, axis=-1).tolist()
    assert [out.tokens[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_greedy_ignores_filters():
    logits = mx.array([[1.0, 3.0, 2.0]])
    row = RowSampling(temperature=0, top_k=1, top_p=0.1, min_p=0.5)
    assert Sampler().sample(logits, [row], positions=[0]).tokens == [1]


def test_bfloat16_logits_are_sampled_like_float32():
    logits = random_logits(4, 300)
    rows = [RowSampling(temperature=0.0), RowSampling(seed=3, top_k=10)] * 2
    as_f32 = Sampler().sample(logits.astype(mx.bfloat16).astype(mx.float32), rows, [5] * 4)
    as_bf16 = Sampler().sample(logits.astype(mx.bfloat16), rows, [5] * 4)
    assert as_bf16.tokens == as_f32.tokens


# -- temperature and filters ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_softmax_of_scaled_logits(temperature):
    logits = [1.0, 0.5, -0.3, 0.2]
    counts = draw_many(logits, RowSampling(temperature=temperature))
    assert_frequencies_match(counts, probs_of(logits, temperature), tolerance=0.03)


def test_top_k_1_is_greedy():
    logits = random_logits(16, 700)
    out = Sampler().sample(logits, [RowSampling(temperature=1.5, top_k=1)] * 16, [0] * 16)
    assert out.tokens == mx.argmax(logits, axis=-1).tolist()


def test_top_k_2_never_picks_outside_the_top_two():
    logits = [2.0, 1.9, 0.1, 1.8, -1.0]  # top two: tokens 0 and 1
    counts = draw_many(logits, RowSampling(temperature=2.0, top_k=2))
    assert set(counts) == {0, 1}
    p = probs_of([2.0, 1.9], 2.0)
    assert_frequencies_match(counts, p, tolerance=0.03)


def test_small_top_p_keeps_only_the_top_token():
    logits = [0.3, 0.5, 0.4, 0.1]
    counts = draw_many(logits, RowSampling(temperature=1.0, top_p=0.01), n=500)
    assert set(counts) == {1}


def test_top_p_keeps_the_smallest_set_that_reaches_the_mass():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    counts = draw_many(logits, RowSampling(top_p=0.75))
    assert set(counts) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert_frequencies_match(counts, [0.5 / 0.8, 0.3 / 0.8], tolerance=0.03)
    assert set(draw_many(logits, RowSampling(top_p=0.85))) == {0, 1, 2}


def test_min_p_drops_tokens_below_that_fraction_of_the_top_probability():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    counts = draw_many(logits, RowSampling(min_p=0.5))  # keeps p >= 0.2
    assert set(counts) == {0, 1, 2}
    assert_frequencies_match(counts, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9], tolerance=0.03)
    assert set(draw_many(logits, RowSampling(min_p=0.6, top_k=3, top_p=0.99))) == {0, 1}


def test_filters_apply_after_temperature():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    # At T=0.5 the probabilities are ~(0.53, 0.30, 0.13, 0.03): min_p 0.5 keeps only 0 and 1.
    assert set(draw_many(logits, RowSampling(temperature=0.5, min_p=0.5))) == {0, 1}


def test_a_row_without_filters_can_still_draw_an_unlikely_token_beside_filtered_rows():
    logits = mx.array([[3.0, 0.0, 0.0, 0.0]] * 2000)
    rows = [RowSampling(top_k=1), RowSampling()] * 1000
    tokens = Sampler().sample(logits, rows, [0] * 2000).tokens
    assert set(tokens[0::2]) == {0}
    assert set(tokens[1::2]) == {0, 1, 2, 3}


def test_filters_reaching_past_the_candidate_tokens_are_still_exact(monkeypatch):
    # Thresholds normally come from each row's best few tokens; a nucleus or a top_k wider than
    # those must give the same allowed set as a full sort.
    monkeypatch.setattr(sampling, "_NUM_CANDIDATES", 4)
    logits = [math.log(p) for p in (0.2, 0.15, 0.14, 0.13, 0.12, 0.11, 0.1, 0.05)]
    nucleus = draw_many(logits, RowSampling(top_p=0.7))  # needs 0.2+...+0.12 = 0.74: 5 tokens
    assert set(nucleus) == {0, 1, 2, 3, 4}
    assert_frequencies_match(nucleus, [p / 0.74 for p in (0.2, 0.15, 0.14, 0.13, 0.12)], 0.03)
    assert set(draw_many(logits, RowSampling(top_k=6))) == {0, 1, 2, 3, 4, 5}
    both = draw_many(logits, RowSampling(top_k=6, top_p=0.6))  # of the top 6 (0.85): 0.6 * 0.85
    assert set(both) == {0, 1, 2, 3}


# -- seeds ----------------------------------------------------------------------------------------


def test_seeded_row_gives_the_same_tokens_alone_and_inside_a_mixed_batch():
    vocab = 3000  # more than the filter candidates, so batches mix the partial and full paths
    seeded = RowSampling(temperature=0.9, top_p=0.95, seed=1234)
    others = [
        RowSampling(temperature=0),
        RowSampling(temperature=1.3, top_p=0.9),
        RowSampling(temperature=0.7, top_k=40, seed=7),
        RowSampling(min_p=0.05, logprobs=2),
        RowSampling(top_k=2000, top_p=0.999),
    ]
    for position in range(12):
        logits = random_logits(6, vocab, seed=position)
        alone = Sampler(seed=1).sample(logits[3:4], [seeded], [position]).tokens[0]
        rows = [*others[:3], seeded, *others[3:]]
        batch = Sampler(seed=2).sample(logits, rows, [position + 1] * 3 + [position] * 3)
        assert batch.tokens[3] == alone


def test_same_seed_position_and_logits_give_the_same_token_twice():
    logits = random_logits(1, 5000)
    row = RowSampling(temperature=1.0, seed=99)
    first = Sampler(seed=0).sample(logits, [row], [17]).tokens
    second = Sampler(seed=12345).sample(logits, [row], [17]).tokens
    assert first == second


def test_seeded_row_draws_fresh_randomness_at_each_position():
    logits = mx.zeros((1, 1000))
    row = RowSampling(seed=5)
    tokens = [Sampler().sample(logits, [row], [t]).tokens[0] for t in range(20)]
    assert len(set(tokens)) > 15


def test_different_seeds_draw_different_tokens():
    logits = mx.zeros((20, 1000))
    rows = [RowSampling(seed=s) for s in range(20)]
    assert len(set(Sampler().sample(logits, rows, [0] * 20).tokens)) > 15


def test_unseeded_rows_vary_across_calls_and_between_rows():
    logits = mx.zeros((4, 1000))
    sampler = Sampler(seed=0)
    calls = [tuple(sampler.sample(logits, [RowSampling()] * 4, [0] * 4).tokens) for _ in range(5)]
    assert len(set(calls)) == 5
    assert len(set(calls[0])) > 1


def test_the_sampler_seed_makes_unseeded_rows_reproducible():
    logits = random_logits(8, 1000)

    def run(seed: int) -> list[list[int]]:
        sampler = Sampler(seed=seed)
        return [sampler.sample(logits, [RowSampling()] * 8, [0] * 8).tokens for _ in range(3)]

    assert run(3) == run(3)
    assert run(3) != run(4)


# -- penalties ------------------------------------------------------------------------------------


def history_of(prompt: list[int], generated: list[int]) -> RowHistory:
    history = RowHistory(prompt)
    for token in generated:
        history.append(token)
    return history


def greedy_with(row: RowSampling, logits: list[float], history: RowHistory) -> int:
    return Sampler().sample(mx.array([logits]), [row], [0], [history]).tokens[0]


def test_presence_penalty_steers_away_from_generated_tokens():
    logits = [2.0, 1.5, 0.0]
    row = RowSampling(temperature=0, presence_penalty=1.0)
    assert greedy_with(row, logits, history_of([], [])) == 0
    assert greedy_with(row, logits, history_of([], [0])) == 1  # 2.0 - 1.0 < 1.5


def test_presence_penalty_ignores_the_prompt():
    row = RowSampling(temperature=0, presence_penalty=1.0)
    assert greedy_with(row, [2.0, 1.5, 0.0], history_of([0], [])) == 0


def test_frequency_penalty_grows_with_each_repetition():
    logits = [2.0, 1.5, 0.0]
    row = RowSampling(temperature=0, frequency_penalty=0.3)
    assert greedy_with(row, logits, history_of([], [0])) == 0  # 2.0 - 0.3 > 1.5
    assert greedy_with(row, logits, history_of([], [0, 0])) == 1  # 2.0 - 0.6 < 1.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = RowSampling(temperature=0, repetition_penalty=2.0)
    assert greedy_with(row, [2.0, 1.5, 0.0], history_of([0], [])) == 1  # prompt: 2.0 -> 1.0
    assert greedy_with(row, [-1.0, -1.5, -3.0], history_of([], [0])) == 1  # -1.0 -> -2.0


def test_only_rows_with_penalties_are_penalised():
    logits = mx.array([[2.0, 1.5, 0.0]] * 2)
    rows = [RowSampling(temperature=0, presence_penalty=1.0), RowSampling(temperature=0)]
    histories = [history_of([], [0]), history_of([], [0])]
    assert Sampler().sample(logits, rows, [1, 1], histories).tokens == [1, 0]


def test_a_row_with_a_penalty_but_no_history_is_rejected():
    with pytest.raises(ValueError, match="histories"):
        Sampler().sample(mx.zeros((1, 4)), [RowSampling(frequency_penalty=0.5)], [0], [None])


def test_a_history_with_a_token_outside_the_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler().sample(
            mx.zeros((1, 4)), [RowSampling(repetition_penalty=1.2)], [0], [RowHistory([9])]
        )


def penalised_by_hand(raw: mx.array, rows, histories) -> list[list[float]]:
    """The penalties as their definitions say: over the context's last `repeat_last_n`
    tokens (all of them where None), the repetition penalty at every distinct token there,
    presence and frequency at the generated ones."""
    out = raw.tolist()
    for x, row, history in zip(out, rows, histories, strict=True):
        if history is None or not row.needs_history:
            continue
        context = [history.token_at(k) for k in range(history.num_tokens)]
        n = row.repeat_last_n
        start = 0 if n is None else max(0, len(context) - n)
        for t in set(context[start:]):
            rep = row.repetition_penalty
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        generated = context[max(start, history.num_prompt) :]
        for t, count in Counter(generated).items():
            x[t] -= row.presence_penalty + row.frequency_penalty * count
    return out


def test_penalties_kept_from_step_to_step_equal_penalties_built_from_the_whole_history():
    """The decode batch keeps its penalty arrays and adds each step's tokens to them; the
    logits they give are those of arrays built afresh, bit for bit."""
    rows = [
        RowSampling(temperature=0, repetition_penalty=1.3),
        RowSampling(temperature=0),
        RowSampling(presence_penalty=0.5, frequency_penalty=0.25),
        RowSampling(repetition_penalty=0.8, frequency_penalty=-0.4, seed=1),
    ]
    histories = [RowHistory([1, 2, 2, 9]), None, RowHistory([3]), RowHistory([])]
    kept = SamplingRows(rows)
    for step in range(12):
        raw = mx.random.normal((4, 32), key=mx.random.key(step))
        fresh = apply_penalties(raw, SamplingRows(rows).penalties(histories, 32))
        assert mx.array_equal(apply_penalties(raw, kept.penalties(histories, 32)), fresh)
        assert mx.allclose(fresh, mx.array(penalised_by_hand(raw, rows, histories)), atol=1e-5)
        for i, history in enumerate(histories):
            for token in [(step + i) % 5, 7] if step % 3 else [(step * i) % 32]:
                if history is not None:
                    history.append(token)  # repeats, new ids, and two tokens in one step


def test_a_window_penalises_only_the_last_n_tokens_as_ollama_s_repeat_last_n():
    logits = [2.0, 1.5, 0.0]
    history = history_of([0], [2, 2])  # token 0 is the prompt's, three tokens back
    assert greedy_with(RowSampling(temperature=0, repetition_penalty=2.0), logits, history) == 1
    windowed = RowSampling(temperature=0, repetition_penalty=2.0, repeat_last_n=2)
    assert greedy_with(windowed, logits, history) == 0  # 0 is out of the window: 2.0 stays
    nothing = RowSampling(temperature=0, repetition_penalty=2.0, repeat_last_n=0)
    assert not nothing.needs_history  # no token to look at: no penalty
    presence = RowSampling(temperature=0, presence_penalty=1.0, repeat_last_n=1)
    assert greedy_with(presence, logits, history_of([], [0, 2])) == 0  # 0 left the window


def test_windowed_penalties_kept_from_step_to_step_equal_the_definition():
    """Rows with windows (tokens leave them, come back, several a step) beside rows
    without: the kept arrays give the logits of arrays built afresh, bit for bit, and those
    of the penalties computed from their definition."""
    rows = [
        RowSampling(temperature=0, repetition_penalty=1.3, repeat_last_n=4),
        RowSampling(presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=3),
        RowSampling(temperature=0),
        RowSampling(repetition_penalty=0.8, frequency_penalty=-0.4, seed=1),
        RowSampling(repetition_penalty=1.5, presence_penalty=-0.3, repeat_last_n=1),
        RowSampling(repetition_penalty=1.2, frequency_penalty=0.7, repeat_last_n=64),
        RowSampling(repetition_penalty=1.2, repeat_last_n=0),
    ]
    prompts = [[1, 2, 2, 9], [3, 3, 4], [], [5], [6, 7], list(range(20)), [1]]
    histories = [RowHistory(p) for p in prompts]
    histories[2] = None  # no penalty: no history
    kept = SamplingRows(rows)
    for step in range(16):
        raw = mx.random.normal((len(rows), 32), key=mx.random.key(step))
        fresh = apply_penalties(raw, SamplingRows(rows).penalties(histories, 32))
        assert mx.array_equal(apply_penalties(raw, kept.penalties(histories, 32)), fresh)
        assert mx.allclose(fresh, mx.array(penalised_by_hand(raw, rows, histories)), atol=1e-5)
        for i, history in enumerate(histories):
            for token in [(step + i) % 5, 7] if step % 3 else [(step * i) % 32, 9, 9, 1, 2]:
                if history is not None:
                    history.append(token)


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = random_logits(3, 200)
    rows = [
        RowSampling(temperature=0, logprobs=5),
        RowSampling(temperature=0.5, top_k=3, presence_penalty=2.0, logprobs=3),
        RowSampling(temperature=0),
    ]
    histories = [None, history_of([], [1, 2, 3]), None]
    out = Sampler().sample(logits, rows, [0, 3, 0], histories)
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()

    assert out.logprobs[2] is None
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp.token_id == out.tokens[i]
        assert lp.logprob == pytest.approx(expected[i][lp.token_id], abs=1e-4)
        assert len(lp.top) == rows[i].logprobs
        best = sorted(range(200), key=lambda t, i=i: expected[i][t], reverse=True)
        assert [t for t, _ in lp.top] == best[: rows[i].logprobs]
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        for token, value in lp.top:
            assert value == pytest.approx(expected[i][token], abs=1e-4)


def test_logprobs_zero_gives_the_chosen_token_only():
    out = Sampler().sample(mx.array([[0.0, 1.0]]), [RowSampling(temperature=0, logprobs=0)], [0])
    assert out.logprobs[0].top == ()
    assert out.logprobs[0].logprob == pytest.approx(math.log(probs_of([0.0, 1.0])[1]), abs=1e-5)


def test_logprobs_of_a_token_resampled_past_the_candidates_belong_to_that_token(monkeypatch):
    monkeypatch.setattr(sampling, "_NUM_CANDIDATES", 2)
    logits = mx.array([[0.1 * t for t in range(8)]] * 64)
    expected = (logits[0] - mx.logsumexp(logits[0])).tolist()
    out = Sampler().sample(logits, [RowSampling(top_p=0.9, logprobs=1)] * 64, [0] * 64)
    assert len(set(out.tokens)) > 2
    for lp, token in zip(out.logprobs, out.tokens, strict=True):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(expected[token], abs=1e-5)


def test_a_batchs_token_array_holds_its_tokens_also_where_rows_were_resampled(monkeypatch):
    """The runner feeds the sampled array straight into the next forward, so it must be the
    tokens returned, also for rows whose nucleus reached past the candidates."""
    monkeypatch.setattr(sampling, "_NUM_CANDIDATES", 2)
    logits = mx.array([[0.1 * t for t in range(8)]] * 16)
    rows = [RowSampling(top_p=0.95), RowSampling(temperature=0)] * 8
    pending = Sampler().start(logits, rows, [0] * 16)
    out = pending.finish()
    assert len(set(out.tokens[::2])) > 2  # past the 2 candidates
    assert pending.tokens.tolist() == out.tokens


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2**31),
        ("top_k", 1.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("min_p", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", 10.5),
        ("repetition_penalty", math.nan),
        ("presence_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", math.nan),
        ("logprobs", -1),
    ],
)
def test_invalid_parameters_raise_an_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RowSampling(**{field: value})


def test_a_batch_whose_rows_and_parameters_disagree_is_rejected():
    with pytest.raises(ValueError, match="one of each per row"):
        Sampler().sample(mx.zeros((2, 4)), [RowSampling()], [0, 0])


def test_history_counts_what_the_executor_appends():
    history = history_of([5, 6, 5], [7, 7, 5])
    assert history.seen_ids == {5, 6, 7}
    assert history.generated == [7, 7, 5]
    assert history.num_generated == 3


def test_top_k_minus_one_means_off_like_zero():
    assert RowSampling(top_k=-1) == RowSampling(top_k=0)


def test_a_temperature_below_the_greedy_epsilon_samples_greedily():
    logits = random_logits(4, 64, seed=3)
    tiny = Sampler(seed=0).sample(logits, [RowSampling(temperature=1e-6)] * 4, [0] * 4)
    greedy = Sampler(seed=0).sample(logits, [RowSampling(temperature=0)] * 4, [0] * 4)
    assert tiny.tokens == greedy.tokens == mx.argmax(logits, axis=-1).tolist()
    assert RowSampling(temperature=sampling.GREEDY_TEMPERATURE).is_greedy is False
