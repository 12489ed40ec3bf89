"""`stepline replay LOG1 LOG2`: the logs of several engines (behind a router), side by side.

The logs are real: two demo-model engines, each with its own event log, each serving its own
requests. Engine a serves two chats with one system prompt, one after the other, so the second
starts from the first's prefix-cache checkpoint; both engines serve a request `again` (a
request the router retried on the other engine).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from stepline.api.cli import main
from stepline.events.replay import summarize
from stepline.events.replay.engines import EngineSummaries, engine_names

SYSTEM = "you are a terse assistant who answers in one word. " * 8
REQUESTS = {
    "engine-a": ("a0", "a1", "again"),
    "engine-b": ("b0", "b1", "b2", "again"),
}


async def _serve(log: Path, request_ids: tuple[str, ...]) -> None:
    from stepline.api import Engine, SamplingParams

    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async with Engine.open(
        "stepline-demo", event_log=str(log), max_step_ms=None, max_step_tokens=64
    ) as engine:
        for rid in request_ids:  # one after the other: a1 finds a0's system prompt cached
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {rid}"},
            ]
            async for _ in engine.generate(messages=messages, params=greedy, request_id=rid):
                pass


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory, model_cache_dir) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("engines")
    paths = tuple(folder / f"{name}.jsonl" for name in REQUESTS)
    for path, ids in zip(paths, REQUESTS.values(), strict=True):
        asyncio.run(_serve(path, ids))
    return paths  # type: ignore[return-value]


def _replay(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main(["replay", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _row(text: str, name: str) -> list[str]:
    """The figures of `name`'s row in the table that opens the summary (its first line)."""
    line = next(ln for ln in text.splitlines() if ln.startswith(f"  {name} "))
    return line[len(name) + 2 :].split()


def test_each_request_is_listed_under_the_engine_that_served_it(logs, capsys) -> None:
    code, out, _ = _replay(capsys, *logs)

    assert code == 0
    assert "2 engines' logs" in out
    listing = out[out.index("requests by engine") :].splitlines()
    assert listing[1].split() == ["engine-a", "3:", "a0,", "a1,", "again"]
    assert listing[2].split() == ["engine-b", "4:", "b0,", "b1,", "b2,", "again"]
    assert "in more than one engine's log (1; retried?): again (engine-a, engine-b)" in out
    a, b = out.index("== engine engine-a =="), out.index("== engine engine-b ==")
    assert f"log {logs[0]} (1 file)" in out[a:b] and f"log {logs[1]} (1 file)" in out[b:]


def test_each_engines_figures_are_its_logs_summary_and_all_add_up(logs, capsys) -> None:
    code, out, _ = _replay(capsys, *logs, "--summary")

    assert code == 0
    summaries = [summarize(log) for log in logs]
    assert summaries[0].num_cached_tokens > 0  # a1 started from a0's system prompt
    for name, s in zip(REQUESTS, summaries, strict=True):
        figures = [
            s.num_requests,
            s.outcomes.get("length", 0),
            0,  # failed
            s.num_prompt_tokens,
            s.num_cached_tokens,
            s.num_prefilled_tokens,
            s.num_output_tokens,
        ]
        assert _row(out, name) == [*map(str, figures), "stepline-demo"]
        assert f"requests: {s.num_requests} ({s.num_requests} length)" in out
    in_all = _row(out, "in all")
    assert int(in_all[0]) == 7
    assert int(in_all[5]) == sum(s.num_prefilled_tokens for s in summaries)
    assert int(in_all[3]) == sum(s.num_prompt_tokens for s in summaries)


def test_json_gives_each_engines_summary_and_which_engine_served_which_request(
    logs, capsys
) -> None:
    code, out, _ = _replay(capsys, *logs, "--json")

    assert code == 0
    raw = json.loads(out)
    assert raw["requests"]["a1"] == ["engine-a"] and raw["requests"]["b2"] == ["engine-b"]
    assert raw["requests"]["again"] == ["engine-a", "engine-b"]
    report = EngineSummaries.model_validate_json(out)
    for engine, log in zip(report.engines, logs, strict=True):
        assert engine.log == str(log)
        assert engine.summary == summarize(log)
    totals = [e.totals for e in report.engines]
    assert report.totals.num_prompt_tokens == sum(t.num_prompt_tokens for t in totals)
    assert report.totals.num_finished == 7 and report.totals.num_failed == 0


def test_a_request_is_shown_with_the_engine_that_served_it(logs, capsys) -> None:
    code, out, _ = _replay(capsys, *logs, "--request", "b1")

    assert code == 0
    assert out.startswith(f"request b1: served by engine engine-b ({logs[1]})")
    assert "request b1: " in out.splitlines()[1] and "4 output tokens, length" in out


def test_a_request_in_two_engines_logs_is_shown_in_both(logs, capsys) -> None:
    code, out, _ = _replay(capsys, *logs, "--request", "again", "--json")

    assert code == 0
    found = json.loads(out)["found"]
    assert [f["engine"] for f in found] == ["engine-a", "engine-b"]
    assert all(f["timeline"]["request_id"] == "again" for f in found)

    code, out, _ = _replay(capsys, *logs, "--request", "again")
    assert "request again is in 2 engines' logs (a retried request?)" in out
    assert "== engine engine-a ==" in out and "== engine engine-b ==" in out


def test_an_id_in_no_log_exits_2_naming_the_logs_searched(logs, capsys) -> None:
    code, out, err = _replay(capsys, *logs, "--request", "nobody")

    assert code == 2 and out == ""
    assert "no request 'nobody' in any of the 2 logs searched" in err
    assert str(logs[0]) in err and str(logs[1]) in err


def test_verify_checks_each_engines_log_and_fails_if_one_does(logs, capsys, tmp_path) -> None:
    code, out, _ = _replay(capsys, *logs, "--verify")
    assert code == 0
    assert out.count("OK: no violations") == 3  # each log's, and all of them
    assert out.rstrip().endswith("OK: no violations in any engine's log")

    broken = tmp_path / "engine-c.jsonl"
    lines = logs[1].read_text().splitlines(keepends=True)
    broken.write_text("".join(lines[:2] + lines[3:]))  # an event lost: a gap in the sequence
    code, out, _ = _replay(capsys, logs[0], broken, "--verify")
    assert code == 1
    assert "== engine engine-c ==" in out
    assert out.rstrip().endswith("FAILED: violations in the log of engine engine-c")


def test_the_views_of_one_engines_steps_are_refused(logs, capsys) -> None:
    for view in (["--at-step", "3"], ["--steps", "1..4"], ["--reexecute"], ["--run", "1"]):
        code, out, err = _replay(capsys, *logs, *view)
        assert code == 2 and out == ""
        assert view[0] in err and "replay that log alone" in err


def test_a_log_that_cannot_be_read_exits_2_naming_it(logs, capsys, tmp_path) -> None:
    missing = tmp_path / "gone.jsonl"
    code, _, err = _replay(capsys, logs[0], missing)
    assert code == 2 and str(missing) in err

    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text("this is no event log\n")
    code, _, err = _replay(capsys, garbled, logs[1])
    assert code == 2 and str(garbled) in err


def test_a_rotated_file_given_beside_its_first_file_is_refused(logs, capsys, tmp_path) -> None:
    first, rotated = tmp_path / "run.jsonl", tmp_path / "run.1.jsonl"
    shutil.copy(logs[0], first)
    shutil.copy(logs[1], rotated)

    code, _, err = _replay(capsys, first, rotated)

    assert code == 2
    assert f"{first} and {rotated} are one log set" in err


def test_engines_are_named_by_their_log_and_its_folder_where_names_clash() -> None:
    assert engine_names([Path("x/engine-a.jsonl"), Path("x/engine-b.jsonl")]) == (
        "engine-a",
        "engine-b",
    )
    assert engine_names([Path("east/run.jsonl"), Path("west/run.jsonl")]) == (
        "east/run",
        "west/run",
    )


def test_one_log_reads_as_it_always_did(logs, capsys) -> None:
    code, out, _ = _replay(capsys, logs[0])

    assert code == 0
    assert out.startswith(f"log {logs[0]} (1 file)")
    assert "engines' logs" not in out and "== engine" not in out
