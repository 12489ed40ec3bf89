"""The warm-up: timed steps that seed the step-time model, measured while the engine idles.

Runs on the executor thread, through the runner's public `run` and `housekeep`, with
synthetic greedy requests (no random draws, so the sampler's stream is untouched)
that are freed without entering the prefix cache. It prefills chunks of several
sizes at several offsets, then decodes at two batch sizes, so that every term of
`StepCost` has been seen.

The engine serves before the warm-up has run: the step loop runs it in turns whenever it
has nothing else to do (`Warmup`), and a request that arrives waits for two warm-up steps
at most. Until enough samples are in, the policy schedules by tokens alone and learns from
the live steps. Its samples are kept in stepline's cache (`save_samples`), keyed by what
they measured (the model's weights and dtype, the token budget, this machine and its BLAS),
so a restart of the same engine on the same machine seeds the step-time model with them
before its first step. Live steps correct them as they would the warm-up's own.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from stepline.actors.scheduler.batch_geometry import padded_decode_context
from stepline.actors.scheduler.cost_model import Sample, StepFeatures, decode_runs_apart
from stepline.actors.scheduler.plan import (
    ScheduledChunk,
    ScheduledEncode,
    SchedulerConfig,
    StepPlan,
)
from stepline.actors.scheduler.work import Housekeeping, NewRequest, PrefixReport, StepWork
from stepline.events.models import RequestParams

_PARAMS = RequestParams(
    max_tokens=16, temperature=0, top_p=1, top_k=0, min_p=0, seed=None, ignore_eos=True
)
_PREFIX = "stepline-warmup-"
_FIRST_TOKEN_ID = 3  # past the usual special tokens
# Bump when the warm-up's steps change: samples measured by another recipe are not reused.
# 2: decode context counted as the padded batch; fused and separate mixed steps measured
# 3: the mixed steps' decode row is a short prompt of its own (episodes run in turns)
# 4: prompt attention in blocks on the CPU (engine/cpu_attention.py): steps got faster
# 5: that attention reads no subnormal weights: short prompts' steps got 2x faster
# 6: an audio encoder's units counted apart from an image encoder's (`audio_units`)
# 7: an omni thinker's clip has a unit per window of its audio tower's front end
_RECIPE_VERSION = 7
# Kept samples older than this are measured again (the machine may have changed under them).
MAX_SAMPLE_AGE_S = 7 * 24 * 3600

log = structlog.get_logger(__name__)


def samples_key(**parts: Any) -> str:
    """A file name for the samples measured under `parts` (JSON-able values)."""
    blob = json.dumps({"recipe": _RECIPE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20] + ".json"


def load_samples(path: Path, max_age_s: float = MAX_SAMPLE_AGE_S) -> list[Sample] | None:
    """The samples kept at `path`, or None if there are none (or they are too old, or the
    file is not what `save_samples` writes)."""
    try:
        if time.time() - path.stat().st_mtime > max_age_s:
            return None
        data = json.loads(path.read_text())
        return [Sample(StepFeatures(**s["features"]), float(s["seconds"])) for s in data]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_samples(path: Path, samples: Sequence[Sample]) -> None:
    """Keep `samples` at `path` (written whole, then renamed); a failure is only logged."""
    data = [{"features": asdict(s.features), "seconds": s.seconds} for s in samples]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("warmup_samples_not_kept", path=str(path), error=str(e))


def measure_step_costs(
    runner: Any, config: SchedulerConfig, vocab_size: int, max_context: int
) -> list[Sample]:
    """Run the whole warm-up on `runner` (call on the executor thread) and return its
    samples. Everything it admits is freed before it returns."""
    warmup = Warmup(runner, config, vocab_size, max_context)
    warmup.run()
    return warmup.samples


_Steps = Generator[None, None, None]  # an episode: yields before each of its steps


class Warmup:
    """The warm-up's timed steps, run in turns while the engine has nothing else to do.

    `run` (on the executor thread) measures the steps not yet measured until they are all
    done or `stop()` holds between two steps; either way it frees everything it admitted
    before it returns, so a real step never meets a warm-up request. The steps come in
    episodes (a prompt prefilled in chunks of growing size at growing offsets, then
    decoded; short prompts prefilled beside a decode row, then decoded): a turn stopped
    mid-episode runs that episode again from its start the next time, its steps measured
    before taken again untimed (the chunks as one). A turn that starts measures at least
    one step, so it gets done however short the idle gaps; a request arriving at an
    engine that is still warming up waits for two warm-up steps at most.

    Chunk sizes follow the token budget (and the long-prefill cap), and the longest
    prompt stays well inside `max_context`.
    """

    def __init__(
        self,
        runner: Any,
        config: SchedulerConfig,
        vocab_size: int,
        max_context: int,
        keep_at: Path | None = None,
    ) -> None:
        self.keep_at = keep_at  # where the samples are kept once all are measured
        self.samples: list[Sample] = []
        # What the prefix store reported with the warm-up's steps (a disk write that ended
        # meanwhile): the step loop's index must hear it (`take_prefix_reports`).
        self._prefix_reports: list[PrefixReport] = []
        self.num_turns = 0  # calls to `run` before all was measured
        self.failed: list[str] = []  # the episodes that raised, skipped (`run`)
        self._runner = runner
        self._vocab_size = vocab_size
        cap = min(config.chunk_cap, config.max_step_tokens)
        # Chunks up to half the budget, at offsets up to its size: on SmolLM2 in float32 on
        # a 2-core CPU they take 3.9 s (restarts reuse the samples). Chunks of 1/64 to 1/8
        # took 2.2 s, but a 2,000-token prompt beside 4 decoders then reached its first
        # token ~10% later (23.3 s against 20.9 s, medians of 3 and 2 runs): the fit
        # extrapolated worse to the big chunks at long offsets that such a prompt runs.
        self._sizes = [max(1, cap // d) for d in (16, 8, 4, 2)]
        self._long_len = min(sum(self._sizes) + 1, max(2, max_context // 2))
        self._num_short = max(1, min(3, config.max_num_seqs - 1, config.max_step_tokens // 32))
        self._short_len = max(1, min(16, max_context // 4))
        self._episodes = [self._first_calls, self._chunks_then_decode, self._mixed_steps]
        self._max_context = max_context
        # A vision model's encoder is part of the step that prefills an image's span; an
        # audio model's, a clip's (an omni model has both, each measured: priced apart).
        self._vision = getattr(getattr(runner, "loaded", None), "vision", None)
        if self._vision is not None:
            if self._vision.images is not None:
                self._episodes.append(functools.partial(self._images, medium="image"))
            if self._vision.audio is not None:
                self._episodes.append(functools.partial(self._images, medium="audio"))
        self._next = 0  # the episode the next turn starts (or starts again)
        self._measured = 0  # timed steps of that episode measured by an earlier turn

    @property
    def done(self) -> bool:
        return self._next == len(self._episodes)

    def run(self, stop: Callable[[], bool] = lambda: False) -> list[Sample]:
        """A turn: unless `stop()` holds now, measure at least one step, then more until all
        are measured or `stop()` holds before one. Returns the samples this turn measured
        (also added to `samples`)."""
        measured: list[Sample] = []
        if self.done or stop():
            return measured
        self.num_turns += 1
        checked = False  # the first step of a turn runs whatever `stop` says: progress
        while not self.done:
            session = _Session(self._runner)
            steps = self._episodes[self._next](session, random.Random(self._next), self._measured)
            finished = True
            try:
                for _ in steps:
                    if checked and stop():
                        finished = False
                        break
                    checked = True
            except Exception as exc:  # noqa: BLE001 - the warm-up is an extra, not the engine
                # An episode that fails (an image the vision processor cannot make, a step of
                # its own that raises) is skipped: the engine serves on, its cost model
                # learning those steps from real ones. Its requests are freed below.
                log.warning("warmup_episode_failed", episode=self._next, error=repr(exc))
                self.failed.append(repr(exc))
            finally:
                steps.close()
                session.close()
                measured += session.samples
                self.samples += session.samples
                self._prefix_reports += session.prefix_reports
            if not finished:
                self._measured += len(session.samples)
                return measured
            self._next, self._measured = self._next + 1, 0
        return measured

    def take_prefix_reports(self) -> list[PrefixReport]:
        """The prefix store's reports that the turns so far received, once (call between
        turns): the runner hands each report to the call that asks, and a warm-up step asks."""
        reports, self._prefix_reports = self._prefix_reports, []
        return reports

    def keep(self) -> None:
        """Keep the samples at `keep_at` for the next start (file I/O: not on the loop)."""
        if self.keep_at is not None:
            save_samples(self.keep_at, self.samples)

    def _prompt(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(_FIRST_TOKEN_ID, self._vocab_size) for _ in range(n))

    # An episode yields before each step it measures, so that a turn can stop between two;
    # `done` of its timed steps were measured by an earlier turn: it runs them untimed.

    def _first_calls(self, session: _Session, rng: random.Random, done: int) -> _Steps:
        """Untimed: the first calls allocate and build."""
        rid = session.admit(self._prompt(rng, min(16, self._long_len)))
        session.step(chunks=[(rid, 0, session.prompt_len(rid))], timed=False)
        session.step(timed=False)
        yield from ()

    def _chunks_then_decode(self, session: _Session, rng: random.Random, done: int) -> _Steps:
        """Chunks of growing size at growing offsets, then one decode row."""
        long_len = self._long_len
        long_id = session.admit(self._prompt(rng, long_len))
        ends = [end for end in itertools.accumulate(self._sizes) if end < long_len]
        ends.append(long_len)
        replayed = min(done, len(ends))
        if replayed:  # the chunks measured before, as one (a turn stops after one step)
            session.step(chunks=[(long_id, 0, ends[replayed - 1])], timed=False)
        starts = [0, *ends]
        for i in range(replayed, len(ends)):
            yield
            session.step(chunks=[(long_id, starts[i], ends[i])])
        yield from _measured(done - len(ends), [session.step] * 2)

    def _mixed_steps(self, session: _Session, rng: random.Random, done: int) -> _Steps:
        """Short prompts beside a decode row: first beside a decode forward built a step
        ahead, then (where the runner fuses steps) with the decode row inside the
        prefills' forward; then a few decode steps of them all."""
        short_len = self._short_len
        decoder = session.admit(self._prompt(rng, short_len))
        session.step(chunks=[(decoder, 0, short_len)], timed=False)
        session.step(timed=False)  # decoding, as a running request is
        short_ids = [session.admit(self._prompt(rng, short_len)) for _ in range(self._num_short)]
        half = short_len // 2
        chunks = [[(rid, 0, half) for rid in short_ids]] if half else []
        chunks.append([(rid, half, short_len) for rid in short_ids])
        steps = [functools.partial(session.step, c) for c in chunks] + [session.step] * 3
        yield from _measured(done, steps)

    def _images(
        self, session: _Session, rng: random.Random, done: int, medium: str = "image"
    ) -> _Steps:
        """A vision model's encoder (or, `medium` "audio", an audio model's), beside a decode
        row: units of an image's (a clip's) encoder work in steps of 1, 2 and 3 units (an
        encoder whose work is one unit: whole images).
        The first unit runs untimed (the encoder's first call builds); the image's span is
        never prefilled: its request is freed after."""
        short_len = self._short_len
        decoder = session.admit(self._prompt(rng, short_len))
        session.step(chunks=[(decoder, 0, short_len)], timed=False)
        session.step(timed=False)
        prompt, images = self._image_prompt(rng, (224, 224), medium)
        if len(prompt) >= self._max_context // 2:
            return
        rid = session.admit(prompt, images)
        session.step(chunks=[(rid, 0, images[0].start)], timed=False)
        units = images[0].units
        if units >= 7:
            session.step(encodes=[(rid, 0, 0, 1)], timed=False)
            bounds = [(1, 2), (2, 4), (4, 7)]
            steps = [functools.partial(session.step, encodes=[(rid, 0, a, b)]) for a, b in bounds]
        else:  # whole images: one unit each, three images (the first untimed)
            more = [session.admit(*self._image_prompt(rng, (224, 224), medium)) for _ in range(2)]
            for other in more:
                session.step(chunks=[(other, 0, images[0].start)], timed=False)
            session.step(encodes=[(rid, 0, 0, units)], timed=False)
            steps = [functools.partial(session.step, encodes=[(r, 0, 0, units)]) for r in more]
        yield from _measured(done, steps)

    def _image_prompt(
        self, rng: random.Random, size: tuple[int, int], medium: str = "image"
    ) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """A prompt of a few tokens, an image of `size` pixels (one gray), and a few more;
        with `medium` "audio", a clip of a second (a tone) instead."""
        import io

        assert self._vision is not None
        before, after = self._prompt(rng, 4), self._prompt(rng, 4)
        if medium == "audio":
            span, clip = _tone_span(self._vision.audio, self._runner.loaded.tokenizer, before)
            return (*before, *span, *after), (clip,)

        from PIL import Image

        from stepline.engine.images import ImageData
        from stepline.engine.media import digest_of, place

        out = io.BytesIO()
        pixels = Image.new("RGB", size, (rng.randrange(256),) * 3)
        pixels.save(out, format="PNG")
        png = out.getvalue()
        # Its pixels as made (not decoded again: nothing of a client's file to check).
        data = ImageData(png, digest_of(png), size[0], size[1], "image/png", pixels)
        span, image = place(
            self._vision.images.expand(data), data, self._runner.loaded.tokenizer, len(before)
        )
        return (*before, *span, *after), (image,)


def _tone_span(audio: Any, tokenizer: Any, before: Sequence[int]) -> tuple[list[int], Any]:
    """A second of a 440 Hz tone at the model's rate, placed after `before`."""
    import numpy as np

    from stepline.engine.audio import AudioData
    from stepline.engine.media import digest_of, place

    rate = audio.rate
    samples = (0.1 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
    data = samples.tobytes()
    clip = AudioData(data, digest_of(data), "wav", 1.0, rate, rate, rate, samples)
    return place(audio.expand(clip), clip, tokenizer, len(before))


def _measured(done: int, steps: Sequence[Callable[..., None]]) -> _Steps:
    """Run `steps` (each takes `timed`): the first `done` untimed, each other one timed
    after a yield."""
    for i, step in enumerate(steps):
        if i >= done:
            yield
        step(timed=i >= done)


class _Session:
    """Synthetic requests driven step by step, with the bookkeeping the step loop does."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.samples: list[Sample] = []
        self.prefix_reports: list[PrefixReport] = []  # the results' (see `Warmup`)
        self._prompts: dict[str, int] = {}  # request id -> prompt length
        self._media: dict[str, tuple[str, ...]] = {}  # request id -> its images' media
        self._outputs: dict[str, int] = {}  # decoding request id -> tokens generated
        self._prefilling: set[str] = set()  # requests with a chunk done and more to come
        self._fused = bool(getattr(runner, "fuse", False))
        self._pending: list[NewRequest] = []
        self._step = 0
        self._num_admitted = 0

    def admit(self, prompt: tuple[int, ...], images: tuple[Any, ...] = ()) -> str:
        rid = f"{_PREFIX}{self._num_admitted}"
        self._num_admitted += 1
        self._prompts[rid] = len(prompt)
        self._media[rid] = tuple(getattr(image, "medium", "image") for image in images)
        self._pending.append(
            NewRequest(request_id=rid, prompt_token_ids=prompt, params=_PARAMS, images=images)
        )
        return rid

    def prompt_len(self, rid: str) -> int:
        return self._prompts[rid]

    def step(
        self,
        chunks: Sequence[tuple[str, int, int]] = (),
        timed: bool = True,
        encodes: Sequence[tuple[str, int, int, int]] = (),
    ) -> None:
        """One step of `chunks` (request, start, end), the decode rows, and `encodes`
        (request, image, first unit, end unit)."""
        decodes = tuple(self._outputs)
        apart = bool(decodes and chunks) and decode_runs_apart(
            fused_steps=self._fused, prefilling=bool(self._prefilling)
        )
        features = StepFeatures(
            decode_rows=len(decodes),
            decode_context=padded_decode_context(
                [self._prompts[r] + self._outputs[r] for r in decodes], split=self._fused
            ),
            separate_decode=int(apart),
        )
        scheduled: list[ScheduledChunk] = []
        for rid, start, end in chunks:
            scheduled.append(
                ScheduledChunk(rid, start, end, (), is_final=end == self._prompts[rid])
            )
            features = features.with_chunk(start, end - start)
        scheduled_encodes = tuple(ScheduledEncode(*e) for e in encodes)
        for e in scheduled_encodes:
            features = features.with_encode(e.num_units, self._media[e.request_id][e.image])
        num = {r: 1 for r in decodes} | {c.request_id: c.num_tokens for c in scheduled}
        self._step += 1
        plan = StepPlan(
            step=self._step,
            decodes=decodes,
            chunks=tuple(scheduled),
            encodes=scheduled_encodes,
            num_scheduled_tokens=num,
            features=features,
        )
        starting = set(num) | {e.request_id for e in scheduled_encodes}
        admit = tuple(n for n in self._pending if n.request_id in starting)
        self._pending = [n for n in self._pending if n.request_id not in starting]
        result = self.runner.run(StepWork(plan=plan, admit=admit))
        if result.prefix is not None:
            self.prefix_reports.append(result.prefix)
        self._prefilling = {c.request_id for c in scheduled if not c.is_final}
        for rid in result.tokens:
            self._outputs[rid] = self._outputs.get(rid, 0) + 1
        if timed:
            self.samples.append(Sample(features, result.seconds))

    def close(self) -> None:
        """Free every warm-up request; none goes to the prefix cache."""
        ids = list(self._prompts)
        if ids:
            result = self.runner.housekeep(Housekeeping(free=tuple(ids)))
            if result.prefix is not None:
                self.prefix_reports.append(result.prefix)
