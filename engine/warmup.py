"""A short warm-up at engine start: timed steps that seed the step-time model.

Runs on the executor thread, through the runner's public `run` and `housekeep`, with
synthetic greedy requests (no random draws, so the sampler's stream is untouched)
that are freed without entering the prefix cache. It prefills chunks of several
sizes at several offsets, then decodes at two batch sizes, so that every term of
`StepCost` has been seen at least once before the first real step.

Its samples are kept in stepline's cache (`save_samples`), keyed by what they measured
(the model's weights and dtype, the token budget, this machine and its BLAS), so a restart
of the same engine on the same machine seeds the step-time model with them instead of
measuring again: start-up stays seconds on a model whose warm-up takes seconds. Live steps
correct them as they would the warm-up's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from stepline.engine.cost_model import Sample, StepFeatures, decode_runs_apart
from stepline.engine.policy import (
    ScheduledChunk,
    SchedulerConfig,
    StepPlan,
    padded_decode_context,
)
from stepline.engine.work import Housekeeping, NewRequest, StepWork
from stepline.events.models import RequestParams

_PARAMS = RequestParams(
    max_tokens=16, temperature=0, top_p=1, top_k=0, min_p=0, seed=None, ignore_eos=True
)
_PREFIX = "stepline-warmup-"
_FIRST_TOKEN_ID = 3  # past the usual special tokens
# Bump when the warm-up's steps change: samples measured by another recipe are not reused.
# 2: decode context counted as the padded batch; fused and separate mixed steps measured
_RECIPE_VERSION = 2
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
    """Run a dozen timed warm-up steps on `runner` (call on the executor thread) and
    return their (features, seconds). Everything it admits is freed before it returns.

    Chunk sizes follow the token budget (and the long-prefill cap), and the longest
    prompt stays well inside `max_context`.
    """
    rng = random.Random(0)
    cap = min(config.chunk_cap, config.max_step_tokens)
    # Chunks up to half the budget, at offsets up to its size: on SmolLM2 in float32 on a
    # 2-core CPU they take 3.9 s of a first start (restarts reuse the samples). Chunks of
    # 1/64 to 1/8 took 2.2 s, but a 2,000-token prompt beside 4 decoders then reached its
    # first token ~10% later (23.3 s against 20.9 s, medians of 3 and 2 runs): the fit
    # extrapolated worse to the big chunks at long offsets that such a prompt runs.
    sizes = [max(1, cap // d) for d in (16, 8, 4, 2)]
    long_len = min(sum(sizes) + 1, max(2, max_context // 2))
    num_short = max(1, min(3, config.max_num_seqs - 1, config.max_step_tokens // 32))
    short_len = max(1, min(16, max_context // 4))

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(n))

    session = _Session(runner)
    try:
        session.run_untimed(prompt(min(16, long_len)))  # first calls allocate and build
        long_id = session.admit(prompt(long_len))
        pos = 0
        for n in sizes:  # chunks of growing size at growing offsets
            n = min(n, long_len - pos)
            if n < 1:
                break
            session.step(chunks=[(long_id, pos, pos + n)])
            pos += n
        if pos < long_len:
            session.step(chunks=[(long_id, pos, long_len)])
        for _ in range(2):
            session.step()  # one decode row
        short_ids = [session.admit(prompt(short_len)) for _ in range(num_short)]
        # decode + prefills: first beside a decode forward built a step ahead, then (where
        # the runner fuses steps) with the decode row inside the prefills' forward
        half = short_len // 2
        if half:
            session.step(chunks=[(rid, 0, half) for rid in short_ids])
        session.step(chunks=[(rid, half, short_len) for rid in short_ids])
        for _ in range(3):
            session.step()  # a few decode rows
        return session.samples
    finally:
        session.close()


class _Session:
    """Synthetic requests driven step by step, with the bookkeeping the step loop does."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.samples: list[Sample] = []
        self._prompts: dict[str, int] = {}  # request id -> prompt length
        self._outputs: dict[str, int] = {}  # decoding request id -> tokens generated
        self._prefilling: set[str] = set()  # requests with a chunk done and more to come
        self._fused = bool(getattr(runner, "fuse", False))
        self._pending: list[NewRequest] = []
        self._step = 0
        self._num_admitted = 0

    def admit(self, prompt: tuple[int, ...]) -> str:
        rid = f"{_PREFIX}{self._num_admitted}"
        self._num_admitted += 1
        self._prompts[rid] = len(prompt)
        self._pending.append(NewRequest(request_id=rid, prompt_token_ids=prompt, params=_PARAMS))
        return rid

    def run_untimed(self, prompt: tuple[int, ...]) -> None:
        rid = self.admit(prompt)
        self.step(chunks=[(rid, 0, len(prompt))], timed=False)
        self.step(timed=False)
        self.runner.housekeep(Housekeeping(free=(rid,)))
        del self._outputs[rid], self._prompts[rid]

    def step(self, chunks: Sequence[tuple[str, int, int]] = (), timed: bool = True) -> None:
        decodes = tuple(self._outputs)
        apart = bool(decodes and chunks) and decode_runs_apart(
            fused_steps=self._fused, prefilling=bool(self._prefilling)
        )
        features = StepFeatures(
            decode_rows=len(decodes),
            decode_context=padded_decode_context(
                [self._prompts[r] + self._outputs[r] for r in decodes]
            ),
            separate_decode=int(apart),
        )
        scheduled: list[ScheduledChunk] = []
        for rid, start, end in chunks:
            scheduled.append(
                ScheduledChunk(rid, start, end, (), is_final=end == self._prompts[rid])
            )
            features = features.with_chunk(start, end - start)
        num = {r: 1 for r in decodes} | {c.request_id: c.num_tokens for c in scheduled}
        self._step += 1
        plan = StepPlan(
            step=self._step,
            decodes=decodes,
            chunks=tuple(scheduled),
            num_scheduled_tokens=num,
            features=features,
        )
        admit = tuple(n for n in self._pending if n.request_id in num)
        self._pending = [n for n in self._pending if n.request_id not in num]
        result = self.runner.run(StepWork(plan=plan, admit=admit))
        self._prefilling = {c.request_id for c in scheduled if not c.is_final}
        for rid in result.tokens:
            self._outputs[rid] = self._outputs.get(rid, 0) + 1
        if timed:
            self.samples.append(Sample(features, result.seconds))

    def close(self) -> None:
        """Free every warm-up request; none goes to the prefix cache."""
        ids = list(self._prompts)
        if ids:
            self.runner.housekeep(Housekeeping(free=tuple(ids)))
