"""A step's time, predicted from its plan, and learned online from measured steps. MLX-free.

A step's time is modelled as a linear function of what it computes:

    seconds = step                                   (fixed: the loop, sampling, the thread hop,
                                                      and one forward's reading of the weights)
            + per_chunk * prefill chunks             (each chunk's fixed cost: see below)
            + per_prefill_token * prompt tokens      (the weights' work, linear in tokens)
            + per_attention * sum(n * (start + n/2)) (a chunk of n tokens at offset `start`
                                                      attends to start + i + 1 tokens each)
            + per_decode_row * decode rows
            + per_decode_context * decode rows * the longest row's context
                                                     (the batch cache pads every row to it;
                                                      fitted as per_attention: see `fit`)
            + per_separate_decode * separate_decode  (forwards of their own beside the step's
                                                      one: the decode rows', an embedding
                                                      request's chunk's)
            + per_encode_unit * image encoder units  (a vision model's encoder: its work for
                                                      an image comes in units of like size,
                                                      a step runs some: `engine/vision/`)
            + per_audio_unit * audio encoder units   (an audio tower's, priced apart: an omni
                                                      model's layer of a clip and block of an
                                                      image cost what their towers do)

Where the executor fuses a step (`engine/fused.py`: chunks and decode rows in one forward),
every step reads the weights once, and a chunk's fixed cost is its segment's (its attention
call, its cache writes): small. A step whose decode rows could not ride in its chunks'
forward (their forward was built a step ahead: `decode_runs_apart`), and every step with
both on an executor that does not fuse, reads them once more: `per_separate_decode`. Where
the executor does not fuse, each chunk is a forward of its own, and `per_chunk` learns that.
An embedding request's chunk runs the model's body in a forward of its own (whole prompts of a
step batched into one: `engine/embed.py`), so it also counts a `separate_decode`: each is one
more reading of the weights, which is what that coefficient prices.

`CostModel` fits the coefficients to the most recent steps (a window per kind of step, so
a long run of decode-only steps does not forget what prefill costs; and prefill steps kept
per band of context, so the small late chunks of a long prompt do not make it forget what
a big early chunk costs), plus the warm-up's samples of the kinds of step not yet seen
live: non-negative least squares on relative errors (a 5 ms decode step matters as much as
a 500 ms prefill), then again without the samples the first fit explains worst (a
neighbour's burst of load, a GC pause). The policy takes the fitted `StepCost` as an input
and stays a pure function.

The warm-up runs alone, so it is optimistic: in a serving engine the request actors and the
clients share the machine with the forward passes, and on a 2-core CPU a decode step of
stepline-demo-large took 30-35 ms live against 17 ms in the warm-up. So a kind of step seen
`MIN_SAMPLES` times live no longer takes the warm-up's word for it; the warm-up's samples of
the other kinds are scaled by how much slower the live prefill steps are than the warm-up
predicts (a long prompt's first chunk beside decode rows is often a kind not yet seen
live); and a young model refits often (after 1, 2, 4, 8 live steps) so that the first steps
under load already use what they measured.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

# Fewer samples than this and the fit is not trusted: the policy schedules by tokens only.
MIN_SAMPLES = 8
# A sample is dropped from the refit when its relative error is this many robust standard
# deviations (1.4826 * MAD) from the median error, or 10 percent, whichever is more.
OUTLIER_SIGMAS = 3.0
OUTLIER_FLOOR = 0.10
MAX_TOKENS = 2**31  # "as many as you like": more than any chunk will ever hold
# How much slower (or faster) than the warm-up the live steps may be taken to be when the
# warm-up's samples are scaled to the live ones (median of live / warm-up-predicted).
MAX_LOAD_FACTOR = 4.0
# ...and how many steps' worth of doubt that scale starts with: n live prefill steps move
# it n / (n + SCALE_PRIOR_STEPS) of the way (in log terms) from 1 to what they measured.
SCALE_PRIOR_STEPS = 1
# A step with prefill whose prompt work (its time less the fit's fixed and decode parts) took
# more than SURPRISE times what the fit priced it at prices the next step's prompt work at
# what it took (up to MAX_LOAD_FACTOR times). The fit is robust, and slow to learn a kind of
# step its samples never showed (a chunk deeper into a prompt than any seen: on SmolLM2
# after a first start whose warm-up the traffic cut short, 121-token chunks at offset 1,500
# priced at 0.56 s took 1.0-1.45 s, step after step); meanwhile the decoders pay.
SURPRISE = 1.25
# Prefill steps are kept per band of their chunks' mean context, each band its own window:
# under 256 tokens, under 1024, under 4096, under 16384, and beyond.
CONTEXT_BANDS = (256, 1024, 4096, 16384)


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, in the units the coefficients price."""

    num_chunks: int = 0  # prefill forwards
    prefill_tokens: int = 0  # prompt tokens computed
    prefill_attention: float = 0.0  # sum over chunks of n * (start + n / 2)
    decode_rows: int = 0
    decode_context: int = 0  # decode rows x the longest row's context (padded batch)
    # forwards of their own beside the step's: 1 where the decode rows ran apart from the
    # chunks, plus one for each forward of embedding chunks (`with_chunk(own_forward=True)`)
    separate_decode: int = 0
    encode_units: int = 0  # units of vision-encoder work (images) run in this step
    audio_units: int = 0  # units of audio-encoder work (clips) run in this step

    def with_chunk(self, start: int, num_tokens: int, own_forward: bool = False) -> StepFeatures:
        """Plus a prompt chunk; `own_forward`: it runs in a forward of its own (an embedding
        request's, `engine/embed.py`), one more reading of the weights."""
        return replace(
            self,
            num_chunks=self.num_chunks + 1,
            separate_decode=self.separate_decode + own_forward,
            prefill_tokens=self.prefill_tokens + num_tokens,
            prefill_attention=self.prefill_attention + chunk_attention(start, num_tokens),
        )

    def with_drafts(self, context: int, num_tokens: int) -> StepFeatures:
        """Plus a decode row's drafted tokens (actors/scheduler/drafter.py), verified at its
        `context`: priced as prompt tokens are, inside a forward the step runs anyway."""
        return replace(
            self,
            prefill_tokens=self.prefill_tokens + num_tokens,
            prefill_attention=self.prefill_attention + chunk_attention(context, num_tokens),
        )

    def with_encode(self, units: int, medium: str = "image") -> StepFeatures:
        """Plus `units` of the encoder of `medium` ("image" or "audio")."""
        if medium == "audio":
            return replace(self, audio_units=self.audio_units + units)
        return replace(self, encode_units=self.encode_units + units)

    def vector(self) -> tuple[float, ...]:
        """In `StepCost`'s field order: a leading 1 for the fixed cost."""
        return (
            1.0,
            float(self.num_chunks),
            float(self.prefill_tokens),
            float(self.prefill_attention),
            float(self.decode_rows),
            float(self.decode_context),
            float(self.separate_decode),
            float(self.encode_units),
            float(self.audio_units),
        )

    @property
    def has_prefill(self) -> bool:
        """A step of prompt work: chunks, or an image's or a clip's encoder (kept with the
        prefills, so the decode-only steps' window does not push the encoder's samples out)."""
        return self.num_chunks > 0 or self.encode_units > 0 or self.audio_units > 0

    @property
    def context_band(self) -> int:
        """Which of `CONTEXT_BANDS` the chunks' mean context (keys per query) falls in."""
        mean = self.prefill_attention / self.prefill_tokens if self.prefill_tokens else 0.0
        return sum(mean >= edge for edge in CONTEXT_BANDS)


def decode_runs_apart(*, fused_steps: bool, prefilling: bool) -> bool:
    """Whether a step's decode rows, beside chunks, run in a forward of their own: always
    where the executor does not fuse steps; where it does, when a forward for them was
    built a step ahead, which the runner does only while no prompt is mid-prefill
    (`prefilling`: some request had a chunk and awaits more; `ModelRunner._build_ahead`)."""
    return not fused_steps or not prefilling


def chunk_attention(start: int, num_tokens: int) -> float:
    """Query x context token pairs of a chunk [start, start + n): sum of start + i + 1."""
    return num_tokens * (start + (num_tokens + 1) / 2)


@dataclass(frozen=True)
class StepCost:
    """Fitted seconds per unit of each `StepFeatures` term (all >= 0)."""

    step: float = 0.0
    per_chunk: float = 0.0
    per_prefill_token: float = 0.0
    per_attention: float = 0.0
    per_decode_row: float = 0.0
    per_decode_context: float = 0.0
    per_separate_decode: float = 0.0
    per_encode_unit: float = 0.0
    per_audio_unit: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:  # also refuses nan
                raise ValueError(f"StepCost.{f.name} must be >= 0, got {value}")

    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def predict(self, features: StepFeatures) -> float:
        """Predicted seconds of a step with these features: the coefficients times
        `features.vector()`, written out (the scheduler asks a few times a step)."""
        f = features
        return (
            self.step
            + self.per_chunk * f.num_chunks
            + self.per_prefill_token * f.prefill_tokens
            + self.per_attention * f.prefill_attention
            + self.per_decode_row * f.decode_rows
            + self.per_decode_context * f.decode_context
            + self.per_separate_decode * f.separate_decode
            + self.per_encode_unit * f.encode_units
            + self.per_audio_unit * f.audio_units
        )

    def per_unit(self, medium: str) -> float:
        """What one unit of the encoder of `medium` ("image" or "audio") costs."""
        return self.per_audio_unit if medium == "audio" else self.per_encode_unit

    def prompt_part(self, features: StepFeatures) -> float:
        """The part of `predict` that prices the prompt tokens' own work (per token and per
        attention pair), which a chunk's size scales."""
        return (
            self.per_prefill_token * features.prefill_tokens
            + self.per_attention * features.prefill_attention
        )

    def max_chunk_tokens(self, start: int, seconds: float) -> int:
        """The most tokens a chunk at offset `start` may have so that it costs at most
        `seconds` (0 if not even one token fits). The chunk's cost is per_chunk
        + n * (per_prefill_token + per_attention * (start + 1/2)) + per_attention * n^2 / 2.
        """
        room = seconds - self.per_chunk
        linear = self.per_prefill_token + self.per_attention * (start + 0.5)
        quadratic = self.per_attention / 2
        if room <= 0:
            return 0
        if quadratic == 0 and linear == 0:
            return MAX_TOKENS
        # the positive root of quadratic * n^2 + linear * n - room = 0, in a stable form
        root = 2 * room / (linear + (linear * linear + 4 * quadratic * room) ** 0.5)
        n = int(min(root, MAX_TOKENS))
        # floating point: the rounded root may be a token off either way
        for _ in range(2):
            if n > 0 and self.per_chunk + n * linear + quadratic * n * n > seconds:
                n -= 1
        return n


@dataclass(frozen=True)
class Sample:
    features: StepFeatures
    seconds: float


class CostModel:
    """Learns `StepCost` online from (features, measured seconds) of recent steps, and
    the warm-up's samples (`seed`) as the module docstring says.

    Not thread-safe: the step loop owns it. `observe` is O(1); the fit (numpy, a few
    hundred samples by six features, ~3 ms) runs every `refit_every` observations, and
    with `early_refits` also after the 1st, 2nd, 4th and 8th live one.
    """

    def __init__(
        self,
        window: int = 64,
        refit_every: int = 16,
        seed: Iterable[Sample] = (),
        early_refits: bool = True,
    ) -> None:
        if window < MIN_SAMPLES:
            raise ValueError(f"window must be >= {MIN_SAMPLES}, got {window}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self._seed: list[Sample] = []
        self._seed_cost: StepCost | None = None  # the fit of the warm-up's samples alone
        # decode-only steps and steps with prefill (per band of context): each kind keeps
        # its own recent history
        self._decode: deque[Sample] = deque(maxlen=window)
        band = max(MIN_SAMPLES, window // 2)
        self._prefill = [deque[Sample](maxlen=band) for _ in range(len(CONTEXT_BANDS) + 1)]
        # steps that ran a vision encoder's units: the warm-up's word for them stands until
        # enough of them ran live (in a prefill band, the streams' own prompts crowded them
        # out, and an encoder priced at nothing ran whole: 62 s a step on SmolVLM's shape);
        # an audio encoder's apart, so that an omni model's images do not push out its clips'
        self._encode: deque[Sample] = deque(maxlen=band)
        self._audio: deque[Sample] = deque(maxlen=band)
        self._refit_every = refit_every
        self._early_refits = early_refits  # also refit at 1, 2, 4, 8 live samples
        self._num_live = 0  # live samples observed, ever
        self._since_fit = 0
        self._cost: StepCost | None = None
        self._surprise = 1.0  # the last step's prompt work, measured / priced (see SURPRISE)
        self._last: Sample | None = None  # the last step observed
        for s in seed:
            self.seed(s.features, s.seconds)

    def seed(self, features: StepFeatures, seconds: float) -> None:
        """A warm-up sample. It is kept, and speaks for its kind of step (decode-only, or
        prefill in its band of context) while that kind has been seen fewer than
        `MIN_SAMPLES` times live, so the fit knows every kind of work from the start."""
        if _usable(seconds):
            self._seed.append(Sample(features, seconds))
            self._seed_cost = None  # the warm-up's own fit, made again when needed
            self._since_fit = self._refit_every  # refit at the next read

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """A step with `features` took `seconds` (the executor's measured time)."""
        if not _usable(seconds):
            return
        self._last = sample = Sample(features, seconds)
        self._surprise = self._surprised_by(sample)
        if self._surprise > 1:
            self._since_fit = self._refit_every  # and let the fit see it at once
        self._history(features).append(sample)
        self._since_fit += 1
        self._num_live += 1
        n = self._num_live
        if self._early_refits and n < self._refit_every and n & (n - 1) == 0:
            self._since_fit = self._refit_every  # a power of two: refit at the next read

    def _surprised_by(self, sample: Sample) -> float:
        """How much dearer than priced this step's prompt work was, if more than SURPRISE
        times (capped at MAX_LOAD_FACTOR); 1 otherwise, and for a step without prefill."""
        features = sample.features
        if self._cost is None or not features.has_prefill:
            return 1.0
        prompt = self._cost.prompt_part(features)
        rest = self._cost.predict(features) - prompt
        ratio = (sample.seconds - rest) / prompt if prompt else 1.0
        return min(ratio, MAX_LOAD_FACTOR) if ratio > SURPRISE else 1.0

    def _history(self, features: StepFeatures) -> deque[Sample]:
        """The window of live samples that a step of this kind goes to."""
        if features.audio_units:
            return self._audio
        if features.encode_units:
            return self._encode
        return self._prefill[features.context_band] if features.has_prefill else self._decode

    @property
    def last(self) -> StepCost | None:
        """The last fit, as it is (no refit): enough to predict a step that sizes no chunk."""
        return self._surprised(self._cost)

    def _surprised(self, cost: StepCost | None) -> StepCost | None:
        """`cost` with its prompt work priced as the last step's surprise says."""
        if cost is None or self._surprise == 1:
            return cost
        return replace(
            cost,
            per_prefill_token=cost.per_prefill_token * self._surprise,
            per_attention=cost.per_attention * self._surprise,
        )

    @property
    def cost(self) -> StepCost | None:
        """The current fit (refitted if due), or None while there are too few samples to
        trust one."""
        if self._since_fit >= self._refit_every or (self._cost is None and self._since_fit):
            self._since_fit = 0
            live = [*self._decode, *self._encode, *self._audio]
            live += [s for p in self._prefill for s in p]
            samples = [*self._seed_samples(live), *live]
            if len(samples) >= MIN_SAMPLES:
                self._cost = fit(samples)
                if self._last is not None:  # surprised by what the new fit prices?
                    self._surprise = self._surprised_by(self._last)
        return self._surprised(self._cost)

    def _seed_samples(self, live: list[Sample]) -> list[Sample]:
        """The warm-up's samples of the kinds of step not yet seen enough live, scaled by
        how much slower (or faster) the live steps with prefill are than the warm-up alone
        predicts. Decode-only steps do not set the scale: what slows them down live is
        mostly per-token host work (request actors, clients) that a chunk does not share
        (on the tiny hybrid demo a decode step took 2-3x its warm-up time, a chunk ~1x)."""
        seed = [s for s in self._seed if len(self._history(s.features)) < MIN_SAMPLES]
        if not seed or len(self._seed) < MIN_SAMPLES:
            return seed
        if self._seed_cost is None:
            self._seed_cost = fit(self._seed)
        ratios = sorted(
            s.seconds / p
            for s in live
            if s.features.has_prefill and (p := self._seed_cost.predict(s.features)) > 0
        )
        if not ratios:
            return seed
        # The lower median, trusted in proportion to how many steps say so: one step is
        # taken at the square root of its word (a lone step slowed by a pause must not make
        # every chunk look 5x dearer until its band fills up).
        n = len(ratios)
        ratio = min(max(ratios[(n - 1) // 2], 1 / MAX_LOAD_FACTOR), MAX_LOAD_FACTOR)
        scale = ratio ** (n / (n + SCALE_PRIOR_STEPS))
        return [Sample(s.features, s.seconds * scale) for s in seed]


def _usable(seconds: float) -> bool:
    return seconds > 0 and seconds < float("inf")


# `StepFeatures.vector`'s columns that `fit` prices with one coefficient
_ATTENTION, _DECODE_CONTEXT = 3, 5


def fit(samples: Sequence[Sample]) -> StepCost:
    """Robust non-negative fit of `StepCost` to `samples` (relative errors, two trims).

    A decode row's key costs what a prompt token's query-key pair does (the same products
    and softmax, head by head): one coefficient prices both, `per_attention` and
    `per_decode_context` alike. Fitted apart, a burst's mixed steps (a dozen decode rows
    beside 500 prompt tokens, and no decode-only step at their context) hid prompt work in
    the decode context: on SmolLM2 16 decode rows were priced at 0.65 s against 0.21
    measured, and every step beside them was let run to 2-3.6 s. Raises ValueError for no
    samples.
    """
    import numpy as np  # here, not at import: the policy imports this module

    if not samples:
        raise ValueError("fit needs at least one sample")
    x = np.array([s.features.vector() for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    x[:, _ATTENTION] += x[:, _DECODE_CONTEXT]  # key pairs, a prompt's and the decode rows'
    x = np.delete(x, _DECODE_CONTEXT, axis=1)
    # Relative errors: divide each row by its own time.
    a, b = x / y[:, None], np.ones_like(y)
    keep = np.ones(len(y), dtype=bool)
    coef = _nnls(a, b)
    for _ in range(2):
        err = a @ coef - b
        mid = np.median(err[keep])
        spread = max(OUTLIER_SIGMAS * 1.4826 * np.median(np.abs(err[keep] - mid)), OUTLIER_FLOOR)
        new_keep = np.abs(err - mid) <= spread
        if new_keep.all() or new_keep.sum() < MIN_SAMPLES or (new_keep == keep).all():
            break
        keep = new_keep
        coef = _nnls(a[keep], b[keep])
    coef = np.insert(coef, _DECODE_CONTEXT, coef[_ATTENTION])
    return StepCost(*(float(c) for c in coef))


def _nnls(a, b):  # type: ignore[no-untyped-def]
    """min ||a x - b|| subject to x >= 0: Lawson and Hanson's active-set method on the
    normal equations (a handful of features: every solve is tiny), with columns scaled to
    unit norm so that one tolerance suits seconds and token counts."""
    import numpy as np

    norms = np.linalg.norm(a, axis=0)
    used = norms > 0
    scale = np.where(used, norms, 1.0)
    a = a / scale
    gram, rhs = a.T @ a, a.T @ b
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.abs(rhs).max()))
    for _ in range(3 * n):
        w = rhs - gram @ x
        candidates = ~passive & used
        if not candidates.any() or w[candidates].max() <= tol:
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            sub = np.ix_(passive, passive)
            z[passive] = np.linalg.lstsq(gram[sub], rhs[passive], rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            # step back towards x until the first coefficient reaches zero; drop it
            neg = passive & (z <= tol)
            gap = x[neg] - z[neg]
            alpha = np.min(np.divide(x[neg], gap, out=np.zeros_like(gap), where=gap > 0))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return np.maximum(x, 0.0) / scale
