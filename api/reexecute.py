"""Re-execution on a fresh engine: `reexecute(path)` runs a recorded run's requests again
through an `Engine` configured as the recorded one was, and compares their tokens
(events/replay/reexecute.py holds the comparison; this module is what runs them). The
engine, and so MLX, is loaded only when something is to run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepline.api.config import EngineConfig
from stepline.api.engine import Engine, SamplingParams
from stepline.events.image_files import read_image
from stepline.events.replay.reexecute import (
    RecordedRequest,
    RecordedRun,
    ReexecutePlan,
    ReexecuteReport,
    Results,
    replay_params,
)
from stepline.events.replay.reexecute import reexecute as _reexecute


async def reexecute(
    path: str | Path,
    model: str | None = None,
    *,
    run: int | None = None,
    name: str | None = None,
    on_plan: Callable[[ReexecutePlan], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ReexecuteReport:
    """Run the requests of one run of the log again through a fresh engine and compare
    tokens: events/replay/reexecute.py's `reexecute`, run by `run_again`. Raises what it
    raises."""
    return await _reexecute(
        path,
        model,
        run_again=run_again,
        run=run,
        name=name,
        on_plan=on_plan,
        on_progress=on_progress,
    )


async def run_again(
    recorded: RecordedRun,
    model: str,
    to_run: list[RecordedRequest],
    on_progress: Callable[[int, int], None] | None,
) -> Results:
    """Submit `to_run` to a fresh engine in their recorded order: each one's (tokens, finish
    reason, why it could not run)."""
    # Configured as the recorded run was, on one process (a distributed run's tokens are
    # the same as one process's).
    engine_options = EngineConfig.from_header(recorded.config).model_copy(update={"parallel": None})
    results: Results = {}

    def finished() -> None:
        if on_progress is not None:
            on_progress(len(results), len(to_run))

    async with Engine.open(model, **engine_options.open_kwargs(), event_log=None) as engine:
        for name, path in recorded.adapters.items():  # loaded while it served
            if name not in engine.adapters:
                await engine.load_adapter(name, path)

        async def consume(rid: str, stream: Any) -> None:
            tokens: list[int] = []
            finish: str | None = None
            async for out in stream:
                tokens.extend(out.token_ids)
                if out.finish_reason is not None:
                    finish = str(out.finish_reason)
            results[rid] = (tokens, finish, None)
            finished()

        tasks = []
        for rec in to_run:  # submitted one after another: the recorded arrival order
            rid = rec.admitted.request_id
            params = replay_params(rec)
            try:
                images = _images(engine, rec, recorded.images_at) if rec.admitted.images else ()
                stream = await engine.submit(
                    rec.admitted.prompt_token_ids,
                    params=SamplingParams(**_accepted(SamplingParams, params.model_dump())),
                    request_id=rid,
                    checkpoints=rec.admitted.checkpoints,
                    client=rec.admitted.client,
                    images=images,
                    adapter=rec.admitted.adapter,
                    door=rec.admitted.door,
                )
            except Exception as exc:  # rejected now, though admitted when recorded
                results[rid] = ([], None, f"not admitted on re-execution: {exc}")
                finished()
                continue
            tasks.append(asyncio.create_task(consume(rid, stream)))
        await asyncio.gather(*tasks)
    return results


def _accepted(target: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The items of `values` that `target` (a pydantic model, dataclass or callable) accepts."""
    if hasattr(target, "model_fields"):
        names = set(target.model_fields)
    elif dataclasses.is_dataclass(target):
        names = {f.name for f in dataclasses.fields(target)}
    else:
        params = inspect.signature(target).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(values)
        names = set(params)
    return {k: v for k, v in values.items() if k in names}


def _images(engine: Any, rec: RecordedRequest, images_at: Path | None) -> tuple[Any, ...]:
    """A recorded request's images and audio clips, read back from beside the log and made
    into what the model's encoders read, at their recorded spans. Raises ValueError for one
    that is gone, or whose span the model makes differently now."""
    from stepline.engine.audio import decode_audio, no_audio
    from stepline.engine.images import decode_image, text_only
    from stepline.engine.media import place

    out = []
    for ref in rec.admitted.images:
        what = "audio clip" if ref.medium == "audio" else "image"
        if ref.medium == "audio" and not engine.accepts_audio:
            raise no_audio()
        if ref.medium == "image" and not engine.accepts_images:
            raise text_only()
        data = read_image(images_at, ref.digest) if images_at is not None else None
        if data is None:
            raise ValueError(f"its {what} {ref.digest[:12]} is not kept beside the log")
        where = f"{what} {ref.digest[:12]}"
        if ref.medium == "audio":
            family = engine.prompts.audio
            clip = decode_audio(data, where=where, rate=family.rate)
            _, placed = place(family.expand(clip), clip, engine.tokenizer, ref.start)
        else:
            image = decode_image(data, where=where)
            expanded = engine.prompts.images.expand(image)
            _, placed = place(expanded, image, engine.tokenizer, ref.start)
        if placed.end != ref.end:
            raise ValueError(
                f"the model makes {placed.end - placed.start} tokens of {where}, the log "
                f"{ref.end - ref.start}"
            )
        out.append(placed)
    return tuple(out)
