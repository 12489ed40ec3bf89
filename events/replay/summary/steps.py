"""The steps, as the summary reads them: what each held (`StepShapes`: the budget it used, its
sequences, what sized its chunks, who sat it out) and how long it took (`StepClock`: against
the step-time target, the slowest, the executor's busy time and the idle time between)."""

from __future__ import annotations

from collections import Counter

from stepline.events.models import StepFinished, StepPlanned
from stepline.events.replay.stats import Distribution, Percentiles, Report, TopK
from stepline.events.replay.timeline import StepSpan


class StepShapes:
    """Per step: tokens / max_step_tokens, sequences; what sized the prompt chunks (limit ->
    chunks) and why runnable requests sat a step out (reason -> times), from schema 7 on."""

    def __init__(self) -> None:
        self.utilisation, self.seqs = Distribution(), Distribution()
        self.limits: Counter[str] = Counter()
        self.held: Counter[str] = Counter()

    def planned(self, event: StepPlanned, span: StepSpan) -> None:
        num_decode = span.num_decode_rows
        if num_decode < len(event.request_ids) and event.limits:
            self.limits.update(filter(None, event.limits[num_decode:]))
        if event.held_reasons:
            self.held.update(event.held_reasons)
        self.utilisation.add(span.num_tokens / event.max_step_tokens)
        self.seqs.add(len(event.request_ids))


class SlowStep(Report):
    step: int
    seconds: float  # the executor's measured time (or, estimated, until the next plan)
    num_tokens: int
    num_seqs: int
    estimated: bool = False  # the log has no step-finished events (written before schema 2)
    run: int = 1
    predicted_s: float | None = None  # the scheduler's cost-model prediction
    warming_up: bool = False  # the engine was warming up
    cpu_share: float | None = None  # the process's CPU seconds per wall second in it
    load_avg: float | None = None  # the machine's load average when it ended


class IdleGap(Report):
    """Time the engine had nothing to run: from a step's end to the next step's plan."""

    after_step: int
    seconds: float
    run: int = 1


class StepTimes(Report):
    """Steps against the step-time target (the engine config's `max_step_ms`), which holds
    for steps with decode rows; and what the host was doing."""

    target_s: float | None  # None: the run has no target (tokens only)
    num_steps: int  # steps measured (with a step-finished event)
    num_decode_steps: int  # of which with decode rows: those the target is for
    num_over: int  # decode steps over the target
    worst_s: float | None  # the longest decode step
    worst_step: int | None
    # measured / predicted time, per step with a prediction (1.0: the cost model was right)
    over_prediction: Percentiles
    num_warming_up: int  # steps the engine ran while warming up
    cpu_share: Percentiles  # the process's CPU seconds per wall second, per step
    load_avg: Percentiles  # the machine's 1-minute load average, per step


def target_s(config: dict) -> float | None:
    """The step-time target of an engine config, in seconds (None: it has none)."""
    ms = config.get("max_step_ms")
    return ms / 1e3 if isinstance(ms, int | float) and ms > 0 else None


class StepClock:
    """Steps' times: measured (step-finished events), or for a log without them estimated as
    the time until the next plan; the `top` slowest steps and longest idle gaps."""

    def __init__(self, top: int) -> None:
        self.target_s: float | None = None
        self.measured = False  # the log has step-finished events
        self.num_measured = self.num_decode_steps = self.num_over = self.num_warming = 0
        self.worst: tuple[float, int] | None = None
        self.over_prediction, self.cpu_share, self.load_avg = (Distribution() for _ in range(3))
        self.busy = 0.0
        self.idle = 0.0
        self.slow_steps, self.idle_gaps = TopK(top), TopK(top)
        self.start_run({})

    def start_run(self, config: dict) -> None:
        """A run of engine `config` begins."""
        self.target_s = target_s(config)
        self.prev_step: StepPlanned | None = None
        self.prev_tokens = 0
        self.prev_finished: StepFinished | None = None

    def loaded(self, config: dict) -> None:
        """The model was loaded with engine `config`: its step-time target holds from here."""
        self.target_s = target_s(config)

    def planned(self, event: StepPlanned, span: StepSpan, run: int) -> None:
        """A step planned: the step before ended (measured), or ends here (estimated)."""
        prev, done = self.prev_step, self.prev_finished
        if prev is not None and done is None:  # no measurement: until the next plan
            gap = event.ts - prev.ts
            if self.slow_steps.would_take(gap):
                slow = _slow(prev, gap, self.prev_tokens, run, estimated=True)
                self.slow_steps.offer(gap, slow)
        elif prev is not None and done is not None:
            idle = max(0.0, event.ts - done.ts)
            self.idle += idle
            if self.idle_gaps.would_take(idle):
                gap_ = IdleGap(after_step=prev.step, seconds=idle, run=run)
                self.idle_gaps.offer(idle, gap_)
        self.prev_step, self.prev_tokens, self.prev_finished = event, span.num_tokens, None

    def finished(self, event: StepFinished, span: StepSpan | None, run: int) -> None:
        """A step's measured time (`span`: the step's, if it is the latest planned)."""
        self.measured = True
        self.num_measured += 1
        seconds = event.seconds
        self.busy += seconds
        if event.predicted_seconds:
            self.over_prediction.add(seconds / event.predicted_seconds)
        if event.warming_up:
            self.num_warming += 1
        if event.cpu_share is not None:
            self.cpu_share.add(event.cpu_share)
        if event.load_avg is not None:
            self.load_avg.add(event.load_avg)
        if span is not None and span.num_decode_rows:
            self.num_decode_steps += 1
            if self.target_s is not None and seconds > self.target_s:
                self.num_over += 1
            if self.worst is None or seconds > self.worst[0]:
                self.worst = (seconds, event.step)
        prev = self.prev_step
        if prev is not None and prev.step == event.step:
            self.prev_finished = event
            if self.slow_steps.would_take(seconds):
                slow = _slow(prev, seconds, self.prev_tokens, run, estimated=False)
                self.slow_steps.offer(
                    seconds,
                    slow.model_copy(
                        update={
                            "predicted_s": event.predicted_seconds,
                            "warming_up": event.warming_up,
                            "cpu_share": event.cpu_share,
                            "load_avg": event.load_avg,
                        }
                    ),
                )

    def busy_s(self) -> float | None:
        """Executor time of every step (None: the log does not measure it)."""
        return self.busy if self.measured else None

    def idle_s(self) -> float | None:
        """Time between a step's end and the next plan, in total (None: not measured)."""
        return self.idle if self.measured else None

    def step_times(self) -> StepTimes | None:
        if not self.num_measured:
            return None
        return StepTimes(
            target_s=self.target_s,
            num_steps=self.num_measured,
            num_decode_steps=self.num_decode_steps,
            num_over=self.num_over,
            worst_s=self.worst[0] if self.worst else None,
            worst_step=self.worst[1] if self.worst else None,
            over_prediction=self.over_prediction.percentiles(),
            num_warming_up=self.num_warming,
            cpu_share=self.cpu_share.percentiles(),
            load_avg=self.load_avg.percentiles(),
        )


def _slow(step: StepPlanned, seconds: float, tokens: int, run: int, *, estimated: bool) -> SlowStep:
    return SlowStep(
        step=step.step,
        seconds=seconds,
        num_tokens=tokens,
        num_seqs=len(step.request_ids),
        estimated=estimated,
        run=run,
    )
