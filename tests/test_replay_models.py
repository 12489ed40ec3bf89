"""`stepline replay` of a log several models share (a server of several models, schema 6).

The real log is written as the pool writes one: two demo-model engines in one process, each
with its place in one shared writer, serving greedy requests at the same time, so that their
events interleave. The hand-made ones (tests/log_builder.py) give loads, unloads, failures
and broken sequences no short run gives.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import replay
from log_builder import T0, LogBuilder

from stepline.actors.turns import Turns
from stepline.events.log import EventLogWriter, read_events, read_models
from stepline.events.models import (
    FinishReason,
    LogHeader,
    ModelLoaded,
    ModelLoadFailed,
    ModelUnloaded,
    new_run_id,
    new_salt,
)
from stepline.events.replay import describe_event, summarize, verify_models

MODELS = {"a": {"model": "stepline-demo"}, "b": {"model": "stepline-demo"}}
PROMPTS = {
    "a": ("hello there, hello there", "one two three four"),
    "b": ("the quick brown fox jumps", "lorem ipsum dolor"),
}


async def _serve(writer: EventLogWriter, name: str, turns: Any) -> None:
    from stepline.actors.scheduler.core import LogPlace
    from stepline.api import Engine, SamplingParams
    from stepline.api.engine_parts import PoolMember

    async with Engine.open(
        "stepline-demo",
        member=PoolMember(writer, LogPlace(name), turns),
        max_step_tokens=32,
        max_num_seqs=4,
    ) as engine:
        engine.step_loop.log_model_event(
            ModelLoaded,
            path="stepline-demo",
            weights_bytes=3 * 2**20,
            kv_bytes=2**30,
            prefix_cache_bytes=2**20,
            load_seconds=0.25,
            config=engine.config,
        )
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        streams = [
            await engine.submit(prompt, params=greedy, request_id=f"{name}{i}")
            for i, prompt in enumerate(PROMPTS[name])
        ]
        for stream in streams:
            async for _ in stream:
                pass


async def _record_two_models(path: Path) -> None:
    header = LogHeader(created=time.time(), models=MODELS, run_id=new_run_id(), salt=new_salt())
    writer = EventLogWriter(path, header)
    try:
        turns = Turns(("a", "b"))  # their steps take turns on the executor, as in a pool's
        await asyncio.gather(_serve(writer, "a", turns), _serve(writer, "b", turns))
    finally:
        writer.close()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, model_cache_dir) -> Path:
    path = tmp_path_factory.mktemp("two-models") / "run.jsonl"
    asyncio.run(_record_two_models(path))
    return path


def test_the_two_models_events_interleave_and_each_reads_as_a_run_of_its_own(
    two_models: Path,
) -> None:
    names = [e.model for e in read_events(two_models)]
    assert set(names) == {"a", "b"}
    assert names != sorted(names)  # interleaved, not one model after the other
    assert read_models(two_models) == ("a", "b")
    for name in ("a", "b"):
        mine = list(read_events(two_models, model=name))
        assert {e.model for e in mine} == {name}
        assert [e.seq for e in mine] == list(range(1, len(mine) + 1))


def test_the_summary_goes_model_by_model_with_each_models_load(two_models: Path) -> None:
    code, text = replay(str(two_models))

    assert code == 0
    assert "2 models (a, b), each on its own" in text
    a, b = text.index("== model a =="), text.index("== model b ==")
    assert a < b
    section_a, section_b = text[a:b], text[b:]
    assert "model a (stepline-demo)" in section_a and "max_step_tokens=32" in section_a
    assert "requests: 2 (2 length)" in section_a and "requests: 2 (2 length)" in section_b
    assert "loads: 1, taking 250.0 ms on average" in section_b
    assert "weights 3.0 MiB, KV 1.00 GiB, prefix cache 1.0 MiB" in section_b


def test_verify_checks_each_model_on_its_own(two_models: Path) -> None:
    code, text = replay(str(two_models), "--verify")

    assert code == 0, text
    assert "== model a ==" in text and "== model b ==" in text
    assert "verify model b of" in text
    assert text.rstrip().endswith("OK: no violations in any model")


def test_a_request_is_found_in_the_model_that_served_it(two_models: Path) -> None:
    code, text = replay(str(two_models), "--request", "b1")
    assert code == 0
    assert text.startswith("request b1 (model b):")
    assert "with b0" in text  # the other requests of its steps are its model's

    code, text = replay(str(two_models), "--request", "b1", "--json")
    assert json.loads(text)["model"] == "b"


def test_a_request_asked_of_another_model_is_not_found(two_models: Path, capsys) -> None:
    assert replay(str(two_models), "--request", "b1", "--model", "a")[0] == 2
    assert "no request 'b1' in model a of" in capsys.readouterr().err


def test_the_state_at_a_step_needs_a_model_and_says_which_there_are(
    two_models: Path, capsys
) -> None:
    code, _ = replay(str(two_models), "--at-step", "3")
    assert code == 2
    assert "holds 2 models (a, b)" in (err := capsys.readouterr().err)
    assert "pick one with --model" in err

    code, text = replay(str(two_models), "--at-step", "3", "--model", "a")
    assert code == 0
    assert text.startswith("state at step 3 of model a:")
    assert "a0" in text and "a1" in text and "b0" not in text


@pytest.mark.parametrize(
    "view",
    [("--steps", "1..3"), ("--svg", "x.svg"), ("--html", "x.html"), ("--trace", "x.json")],
)
def test_every_view_of_steps_needs_a_model(
    two_models: Path, tmp_path: Path, view: tuple[str, str], capsys
) -> None:
    option, value = view
    target = str(tmp_path / value) if option != "--steps" else value
    assert replay(str(two_models), option, target)[0] == 2
    assert "pick one with --model" in capsys.readouterr().err

    assert replay(str(two_models), option, target, "--model", "b")[0] == 0
    if option == "--html":
        page = Path(target).read_text(encoding="utf-8")
        assert "model b (stepline-demo)" in page and "max_step_tokens=32" in page


def test_a_picture_of_a_request_is_drawn_from_its_model(two_models: Path, tmp_path: Path) -> None:
    picture = tmp_path / "one.svg"
    assert replay(str(two_models), "--request", "a1", "--svg", str(picture))[0] == 0
    assert "(model a)" in picture.read_text(encoding="utf-8")


def test_a_model_the_log_does_not_serve_is_an_error_naming_its_models(
    two_models: Path, capsys
) -> None:
    assert replay(str(two_models), "--model", "c")[0] == 2
    assert "no model 'c'" in (err := capsys.readouterr().err) and "its models are a, b" in err


def test_reexecution_needs_a_model_and_reproduces_its_tokens(two_models: Path, capsys) -> None:
    assert replay(str(two_models), "--reexecute")[0] == 2
    assert "pick one with --model" in capsys.readouterr().err

    code, text = replay(str(two_models), "--reexecute", "--model", "b", "--json")
    report = json.loads(text)
    assert code == 0, text
    assert (report["name"], report["model"]) == ("b", "stepline-demo")
    assert [r["request_id"] for r in report["requests"]] == ["b0", "b1"]
    assert (report["num_same"], report["num_diverged"], report["num_skipped"]) == (2, 0, 0)


# -- hand-made logs -------------------------------------------------------------------------


def _model(name: str) -> LogBuilder:
    """Model `name` loads, serves one request, goes idle and is unloaded; its next load
    fails; the one after serves another request. Its seq and steps go on across loads."""
    b = LogBuilder(step_every=0.1, model_name=name)
    loaded = {
        "path": "demo",
        "weights_bytes": 2**20,
        "kv_bytes": 2**21,
        "prefix_cache_bytes": 2**20,
        "config": {"max_step_tokens": 8, "max_num_seqs": 4},
    }
    b.model_event(ModelLoaded, load_seconds=0.5, **loaded)
    b.admit(f"{name}1", 3)
    b.do_step(prefill={f"{name}1": (0, 3)})
    b.do_step(decode=[f"{name}1"])
    b.end(f"{name}1", FinishReason.LENGTH)
    b.model_event(ModelUnloaded, reason="idle", bytes_freed=2**22, idle_seconds=300.0)
    b.model_event(ModelLoadFailed, message="no room: 2.0 GiB needed, 1.0 GiB free")
    b.model_event(ModelLoaded, load_seconds=1.5, **loaded)
    b.admit(f"{name}2", 2)
    b.do_step(prefill={f"{name}2": (0, 2)})
    b.end(f"{name}2", FinishReason.STOP)
    return b


def _write_shared(path: Path, *models: LogBuilder) -> Path:
    """The models' events, interleaved by time, in one log whose header lists them."""
    header = LogHeader(
        created=T0, models={m.model_name: {"model": "demo"} for m in models if m.model_name}
    )
    with EventLogWriter(path, header) as writer:
        for event in heapq.merge(*(m.events for m in models), key=lambda e: e.ts):
            writer.append(event)
    return path


def test_the_summary_tells_each_models_loads_unloads_and_load_failures(tmp_path: Path) -> None:
    path = _write_shared(tmp_path / "run.jsonl", _model("a"), _model("b"))

    code, text = replay(str(path))

    assert code == 0
    section_b = text[text.index("== model b ==") :]
    assert "loads: 2, taking 1.000 s on average (longest 1.500 s)" in section_b
    assert "unloads: 1 idle (4.0 MiB freed)" in section_b
    assert "load failures: 1\n  no room: 2.0 GiB needed, 1.0 GiB free" in section_b
    assert "requests: 2 (1 length, 1 stop)" in section_b
    loads = summarize(path, model="a").loads
    assert loads is not None and (loads.num_loads, loads.num_load_failures) == (2, 1)


def test_the_views_of_one_model_read_past_its_loads_and_unloads(tmp_path: Path) -> None:
    path = _write_shared(tmp_path / "run.jsonl", _model("a"), _model("b"))

    assert replay(str(path), "--verify")[0] == 0
    code, text = replay(str(path), "--at-step", "3", "--model", "b")
    assert code == 0 and "b1  finished: length" in text and "b2  finished: stop" in text
    assert replay(str(path), "--steps", "1..3", "--model", "a")[0] == 0
    assert replay(str(path), "--trace", str(tmp_path / "t.json"), "--model", "a")[0] == 0
    lines = [describe_event(e) for e in read_events(path, model="b") if e.request_id is None]
    assert "model-unloaded b: idle, 4.0 MiB freed, idle 300.0 s" in "\n".join(lines)
    assert "model-load-failed b: no room: 2.0 GiB needed, 1.0 GiB free" in "\n".join(lines)


def test_a_gap_in_one_models_sequence_is_reported_for_that_model_only(tmp_path: Path) -> None:
    b = _model("b")
    assert isinstance(b.events[9], ModelLoadFailed)
    del b.events[9]  # b's tenth event is lost
    path = _write_shared(tmp_path / "run.jsonl", _model("a"), b)

    report = verify_models(path)
    code, text = replay(str(path), "--verify")

    assert not report.ok
    by_model = {r.model: r for r in report.models}
    assert by_model["a"].ok
    assert by_model["b"].counts == {"seq-gap": 1}
    assert code == 1
    assert text.rstrip().endswith("FAILED: violations in model b")
    section_b = text[text.index("== model b ==") :]
    assert "seq-gap: sequence numbers 10 are missing" in section_b


def test_a_request_id_two_models_admit_is_a_violation(tmp_path: Path) -> None:
    a, b = _model("a"), _model("b")
    b.events = [
        e.model_copy(update={"request_id": "a1"}) if e.request_id == "b1" else e for e in b.events
    ]
    b.events = [
        e.model_copy(update={"request_ids": ("a1",) * len(e.request_ids)})
        if getattr(e, "request_ids", None) == ("b1",)
        else e
        for e in b.events
    ]
    report = verify_models(_write_shared(tmp_path / "run.jsonl", a, b))

    by_model = {r.model: r for r in report.models}
    assert by_model["a"].ok
    assert by_model["b"].counts == {"admitted-twice": 1}
    assert "admitted by model b, and before by model a" in by_model["b"].violations[0].message


def test_an_event_of_a_model_the_header_does_not_list_is_a_violation(tmp_path: Path) -> None:
    path = _write_shared(tmp_path / "run.jsonl", _model("a"))
    stray = _model("c").events
    with EventLogWriter(path, LogHeader(created=T0, models={"a": {}}), overwrite=True) as w:
        for event in heapq.merge(_model("a").events, stray, key=lambda e: e.ts):
            w.append(event)

    code, text = replay(str(path), "--verify")

    assert code == 1
    assert "unknown-model: an event of model 'c', which the run's header does not list" in text


def test_a_log_of_one_model_reads_as_before(tmp_path: Path) -> None:
    b = LogBuilder(step_every=0.1)
    b.admit("r1", 3)
    b.do_step(prefill={"r1": (0, 3)})
    b.end("r1", FinishReason.LENGTH)
    path = b.write(tmp_path / "run.jsonl")
    line = path.read_text().splitlines()[1]

    assert '"model"' not in line  # the run's one model is not said on every line
    assert read_models(path) == ("demo",)
    assert list(read_events(path, model="demo")) == list(read_events(path))
    code, text = replay(str(path))
    assert code == 0 and "== model" not in text and text.startswith("log ")
    assert "model demo," in text and "loads:" not in text
    code, text = replay(str(path), "--verify")
    assert code == 0 and text.startswith("verify ") and "OK: no violations" in text
    assert replay(str(path), "--at-step", "1")[0] == 0  # no --model needed
