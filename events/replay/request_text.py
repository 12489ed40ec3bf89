"""One request's timeline as text: what `stepline replay --request` prints, and what the
dashboard shows on a click (`GET /v1/events/requests/{id}/timeline`), with the small
formatters the rest of replay's text shares (api/cli/replay_text.py).
"""

from __future__ import annotations

from stepline.events.replay.describe import describe_tokens
from stepline.events.replay.timeline import format_ms
from stepline.events.replay.views import RequestTimeline
from stepline.events.replay.why import RequestWhy


def secs(seconds: float | None) -> str:
    return format_ms(seconds, decimals=3)


def names_text(ids: tuple[str, ...], limit: int = 5) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f", +{len(ids) - limit} more" if len(ids) > limit else "")


def _text_miss(t: RequestTimeline) -> list[str]:
    """Why its prefix-cache hit stops where it does, in words (none: it missed nothing)."""
    n, miss = t.prefix_shared, t.prefix_miss
    if miss is None:
        return []
    # a chat's checkpoints are its messages' boundaries: which message the prompt broke in
    bounds = [c for c in t.checkpoints if c <= n]
    where = f" (in message {len(bounds) + 1})" if t.checkpoints and n else ""
    why = {
        "cold": "nothing the prefix cache held starts as its prompt does",
        "diverged": f"its prompt first differs from everything the cache held at token {n}{where}",
        "no-snapshot": (
            f"a cached entry shares its first {n} tokens{where}, but this model's cache "
            "(recurrent state, a sliding window) serves an entry only at the offset it was "
            "taken at, and none was taken there"
        ),
        "evicted": f"an entry that shared its first {n} tokens{where} was evicted from the cache",
    }.get(miss, miss)
    return [f"  prefix cache: {t.num_cached_tokens} of {t.num_prompt_tokens} reused; {why}"]


def text_timeline(t: RequestTimeline) -> list[str]:
    cached = f", {t.num_cached_tokens} cached ({t.cache_source})" if t.num_cached_tokens else ""
    if t.terminal:
        end = t.terminal.reason.value + (f" ({t.terminal.message})" if t.terminal.message else "")
        if t.terminal.dimensions is not None:  # an embedding request's end
            end += f" (a vector of {t.terminal.dimensions})"
    elif t.interrupted:
        end = f"interrupted (run {t.run} ended without ending it: the engine stopped)"
    else:
        end = "no terminal event (in flight when the log ends)"
    served = f" (model {t.model})" if t.model is not None else ""
    lines = [
        f"request {t.request_id}{served}: {t.num_prompt_tokens} prompt tokens{cached}, "
        f"{t.num_output_tokens} output tokens, {end}",
        f"  queueing {secs(t.queueing_s)}  TTFT {secs(t.ttft_s)}  ITL p50 {secs(t.itl.p50)} "
        f"p99 {secs(t.itl.p99)} max {secs(t.itl.max)}  end-to-end {secs(t.e2e_s)}",
        *(
            []
            if t.outputs_logged
            else ["  output token ids were not logged (log_outputs=False): only their counts"]
        ),
        *(_text_why(t.why) if t.why is not None else []),
        *_text_miss(t),
        f"  {'step':>6}  {'t':>10}  event",
    ]
    if t.first_step is not None or t.last_step is not None:
        a = "" if t.first_step is None else t.first_step
        b = "" if t.last_step is None else t.last_step
        lines.insert(-1, f"  steps {a}..{b} only")
    if t.first_step is None or t.admitted_step >= t.first_step:
        lines.append(f"  {t.admitted_step:>6}  {secs(0.0):>10}  admitted (seq {t.admitted_seq})")
    shares = {s.step: s for s in t.steps}
    rows: list[tuple[int, int, float, str]] = []  # (seq, step, ts, what)
    for c in t.chunks:
        rows.append((c.seq, c.step, c.ts, f"prefill [{c.start}, {c.end})"))
    for cp in t.checkpoints_reached:
        rows.append((cp.seq, cp.step, cp.ts, f"checkpoint at {cp.offset}"))
    for i, tok in enumerate(t.tokens):
        label = "first token" if i == 0 else "token"
        rows.append(
            (tok.seq, tok.step, tok.ts, f"{label} {describe_tokens(tok.token_ids, tok.num_tokens)}")
        )
    if t.terminal:
        rows.append((t.terminal.seq, t.terminal.step, t.terminal.ts, f"terminal: {end}"))
    seen_steps: set[int] = set()
    for _, step, ts, what in sorted(rows):
        share = shares.get(step)
        context = ""
        if share is not None and step not in seen_steps:
            seen_steps.add(step)
            others = f"with {names_text(share.others)}" if share.others else "alone"
            context = f"   [step: {share.step_tokens}/{share.max_step_tokens} tokens, {others}]"
        lines.append(f"  {step:>6}  {secs(ts - t.admitted_ts):>10}  {what}{context}")
    return lines


def times_text(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("s" if n != 1 else "")


def _text_why(w: RequestWhy) -> list[str]:
    """Where the request's time went: queued, its prefill and what bound it, its stalls."""
    held = ", ".join(f"{reason} {n}" for reason, n in w.held.items())
    queued = (
        f"  queued {secs(w.queued_s)} ({w.num_steps_waiting} steps ran before its first"
        + (f"; it sat out steps for: {held}" if held else "")
        + ")"
    )
    lines = [queued, f"  {w.summary_line()}"]
    if (drafts := w.drafts_line()) is not None:
        lines.append(f"  {drafts}")
    if w.num_suffered:
        causes = "; ".join(
            f"{times_text(c.num_stalls)} by "
            + (f"{c.cause}'s prompt" if c.cause else "steps with no prompt work")
            + f" ({secs(c.seconds)}; worst: step {c.worst_step}, {secs(c.worst_s)})"
            for c in w.suffered
        )
        lines.append(
            f"  stalled {times_text(w.num_suffered)} (waits over {secs(w.stall_threshold_s)}), "
            f"{secs(w.suffered_s)} in total: {causes}"
        )
    if w.caused is not None:
        c = w.caused
        lines.append(
            f"  its prompt stalled other requests' streams {times_text(c.num_stalls)}, "
            f"{secs(c.seconds)} in total over those streams, in {plural(c.num_steps, 'step')} "
            f"(worst: step {c.worst_step}, {secs(c.worst_s)})"
        )
    return lines
