"""A model split across two processes (ring backend over 127.0.0.1), as `mlx.launch` runs it.

Each test starts its ranks as subprocesses (with `mlx.launch`, or with the hostfile and
rank variables it sets, where the test needs each rank's PID), under a timeout, and stops
them by PID.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from helpers import until, until_async

from stepline.api import Engine
from stepline.api.reexecute import reexecute
from stepline.events.log import read_events, read_header

HERE = Path(__file__).parent
WORKER = HERE / "distributed_worker.py"
JOB_TIMEOUT = 90  # seconds a whole job may take on a loaded 2-core box


def _worker_module():
    spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (mlx.launch gives rank r the port start + r)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two adjacent free ports")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _start_ranks(
    tmp_path: Path, argv: list[str], env: dict | None = None
) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 of a ring job, started the way mlx.launch starts them."""
    port = _free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in range(2):
        out = open(tmp_path / f"rank{rank}.out", "wb")  # noqa: SIM115 - the child owns it
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env={
                    **os.environ,
                    **(env or {}),
                    "MLX_RANK": str(rank),
                    "MLX_HOSTFILE": str(hostfile),
                },
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
        out.close()
    return procs


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    _stop(procs)


async def _reference(model: str) -> dict:
    worker = _worker_module()
    async with Engine.open(model, **worker.ENGINE_KWARGS) as engine:
        return await worker.workload(engine)


def _output(tmp_path: Path, rank: int = 0) -> str:
    return (tmp_path / f"rank{rank}.out").read_text(errors="replace")


# -- same tokens as one process -----------------------------------------------------------


def test_tensor_parallel_run_under_mlx_launch_gives_single_process_outputs(demo, tmp_path):
    out, event_log = tmp_path / "out.json", tmp_path / "run.jsonl"
    launch = Path(sys.executable).with_name("mlx.launch")
    argv = [str(launch), "--backend", "ring", "-n", "2", "--starting-port", str(_free_port_pair())]
    argv += [sys.executable, str(WORKER), "stepline-demo", "tensor", str(out), str(event_log)]
    job = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        reference = anyio.run(_reference, "stepline-demo")  # while the job runs
        logs, _ = job.communicate(timeout=JOB_TIMEOUT)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the launcher and both ranks
            job.wait()
    assert job.returncode == 0, logs.decode(errors="replace")
    assert json.loads(out.read_text()) == reference
    assert reference["prefix-hit"]["cached"] == 24  # the checkpoint served the last request
    header, events = read_header(event_log), list(read_events(event_log))
    assert header.config["distributed"] == {"ranks": 2, "backend": "ring", "parallel": "tensor"}
    assert sum(e.type == "checkpoint-reached" for e in events) == 1
    # The log of a distributed run re-executes on one process, to the same tokens.
    report = anyio.run(reexecute, event_log)
    assert report.ok and report.num_same == 5, report.describe()


def test_pipeline_parallel_run_gives_single_process_outputs(demo_hybrid, tmp_path, ranks):
    # qwen3_next: mlx-lm splits it by pipeline only; it mixes ArraysCache and KVCache layers.
    out = tmp_path / "out.json"
    ranks += _start_ranks(tmp_path, [str(WORKER), "stepline-demo-hybrid", "pipeline", str(out)])
    reference = anyio.run(_reference, "stepline-demo-hybrid")
    for rank, p in enumerate(ranks):
        assert p.wait(timeout=JOB_TIMEOUT) == 0, _output(tmp_path, rank)
    assert json.loads(out.read_text()) == reference


# -- refusing what cannot work --------------------------------------------------------------


async def test_parallel_in_a_process_started_alone_says_to_use_mlx_launch(model_cache_dir):
    from stepline.engine.distributed import DistributedError

    with pytest.raises(DistributedError, match="at least 2 ranks.*mlx.launch"):
        async with Engine.open("stepline-demo", parallel="tensor"):
            pass


@pytest.mark.parametrize(
    ("model", "parallel", "says"),
    [
        ("stepline-demo-sliding", "tensor", "neither tensor nor pipeline"),
        ("stepline-demo-hybrid", "tensor", "use --parallel pipeline"),
        ("stepline-demo", "pipeline", "use --parallel tensor"),
    ],
)
async def test_a_model_that_cannot_be_split_so_is_refused_with_what_it_supports(
    model_cache_dir, model, parallel, says
):
    from stepline.engine.distributed import DistributedError

    with pytest.raises(DistributedError, match=says):
        async with Engine.open(model, parallel=parallel):
            pass


# -- failure and shutdown -----------------------------------------------------------------


def _serve(tmp_path: Path, ranks: list, env: dict | None = None) -> str:
    """Start `stepline serve --parallel tensor` on two ranks; rank 0's base URL."""
    argv = ["-m", "stepline.api.cli", "serve", "--parallel", "tensor", "--port", "0"]
    ranks += _start_ranks(tmp_path, [*argv, "--max-step-tokens", "16", "--max-num-seqs", "8"], env)

    def url() -> str:
        for line in _output(tmp_path).splitlines():
            if line.startswith("stepline: serving") and " at " in line:
                return line.split(" at ")[1].split()[0].removesuffix("/v1")
        assert all(p.poll() is None for p in ranks), _output(tmp_path) + _output(tmp_path, 1)
        return ""

    return until(url, within=JOB_TIMEOUT, every=0.2, what="rank 0 serving")


def _sse_data(raw: bytes) -> list:
    # Each event is `id: N` then its `data: ` line.
    frames = [f.partition("\n")[2] for f in raw.decode().split("\n\n") if f.startswith("id: ")]
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:]) for f in frames]


async def test_a_killed_rank_ends_every_request_with_an_error_and_the_job_exits(
    demo, tmp_path, ranks
):
    # Rank 0 ends itself this long after the loss: time for the streams' ends and /health
    # to be read on a busy machine (1 s was not, once).
    url = _serve(tmp_path, ranks, env={"STEPLINE_DIST_EXIT_S": "5"})
    body = {
        "model": "stepline-demo",
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    streams: list[bytes] = [b"", b"", b""]
    started = anyio.Event()

    async def stream(i: int, http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                streams[i] += chunk
                if all(b'"content"' in s for s in streams):
                    started.set()

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(stream, i, http)
                await started.wait()  # every request is decoding: now rank 1 dies
                ranks[1].kill()
        health = await http.get("/health")
    for raw in streams:
        *_, error, done = _sse_data(raw)
        assert done == "[DONE]"
        # Clients get a stable message with their request id; /health says what broke.
        assert "engine failed" in error["error"]["message"]
    assert health.status_code == 503
    assert "rank 1 is lost" in health.json()["reason"]
    assert ranks[0].wait(timeout=30) != 0  # it ends itself: the group cannot be mended
    assert ranks[1].wait(timeout=5) == -signal.SIGKILL


async def test_sigterm_on_rank_0_shuts_every_rank_down(demo, tmp_path, ranks):
    url = _serve(tmp_path, ranks)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "stepline-demo", "prompt": "Once", "max_tokens": 5, "ignore_eos": True},
        )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    ranks[0].send_signal(signal.SIGTERM)
    assert ranks[0].wait(timeout=30) == 0, _output(tmp_path)
    assert ranks[1].wait(timeout=10) == 0, _output(tmp_path, 1)


async def test_a_rank_lost_while_no_request_runs_is_found_by_the_ping(demo, tmp_path, ranks):
    env = {"STEPLINE_DIST_PING_S": "0.5", "STEPLINE_DIST_EXIT_S": "3"}
    url = _serve(tmp_path, ranks, env=env)
    ranks[1].kill()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def unhealthy() -> httpx.Response | None:
            health = await http.get("/health")
            return health if health.status_code != 200 else None

        health = await until_async(unhealthy, within=20, every=0.1, what="the rank lost seen")
        refused = await http.post(
            "/v1/completions", json={"model": "stepline-demo", "prompt": "Once", "max_tokens": 5}
        )
    assert health.status_code == 503 and "rank 1 is lost" in health.json()["reason"]
    assert refused.status_code == 503
    assert ranks[0].wait(timeout=30) != 0
