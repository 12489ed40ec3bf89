"""Open WebUI on the default model, as a new user meets it: issue 54's targets.

`stepline serve` with every default (SmolLM2-135M-Instruct, no flags) behind a real Open WebUI
(in its own venv: the README's Open WebUI command), driven in headless Chromium through the
OpenAI and the Ollama doors. For each question it prints how long the answer took to end by
itself (no Stop), its length, and how long after it Open WebUI's background jobs (the title
and the follow-up suggestions) took to end. With `--event-log PATH` the server writes its event
log there, and the run ends with every request Open WebUI sent, from that log: which job it
was (answer, title, follow-ups, tags: told by its prompt), its cap and penalty as admitted,
its prompt and output tokens, how it ended, its queueing and TTFT, its time, and how its text
ends.

    .venv/bin/python benchmarks/open_webui.py [--questions 3] [--open-webui PATH]
        [--event-log PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "What is a prime number?",
    "How do plants make their food?",
    "Name the planets of the solar system.",
]


@dataclass
class Server:
    url: str


async def one(webui: str, model: str, question: str) -> tuple[float, int, float, str]:
    from browser import chromium_page
    from helpers import until_async
    from test_open_webui import answers, fetch_json, new_chat

    async with chromium_page(f"{webui}/?model={model}") as page:
        sent = time.monotonic()
        chat_id = await new_chat(page, model, question)

        async def ended() -> dict | None:
            [answer] = answers(await fetch_json(page, f"/api/v1/chats/{chat_id}"))
            return answer if answer.get("done") else None

        answer = await until_async(ended, within=900, what="the answer's end")
        answered = time.monotonic()

        async def jobs_done() -> dict | None:
            chat = await fetch_json(page, f"/api/v1/chats/{chat_id}")
            [done] = answers(chat)
            return (
                chat if chat["title"] != "New Chat" and done.get("followUps") is not None else None
            )

        chat = await until_async(jobs_done, within=900, what="the title and follow-ups")
        return answered - sent, len(answer["content"]), time.monotonic() - answered, chat["title"]


# Which Open WebUI job a request is, by the words its prompt begins its task with.
JOBS = {
    "Predict 3-5 useful messages": "follow-ups",
    "Generate a concise title": "title",
    "Generate 1-3 broad tags": "tags",
}


def report(path: Path) -> None:
    """Every request of the event log at `path`, one line each, and how its text ends."""
    from stepline.engine.models import model_source, read_tokenizer
    from stepline.events.log_reader import read_events
    from stepline.events.models import Admitted, TokensSampled

    admitted: dict[str, Admitted] = {}
    first_step: dict[str, float] = {}  # request -> when its first step was planned
    tokens: dict[str, list[int]] = {}
    token_ts: dict[str, list[float]] = {}
    ends: dict[str, tuple[str, float]] = {}
    for e in read_events(path):
        if isinstance(e, Admitted):
            admitted[e.request_id] = e
        elif e.type == "step":
            for rid in e.request_ids:
                first_step.setdefault(rid, e.ts)
        elif isinstance(e, TokensSampled):
            for d in e.decodings():
                tokens.setdefault(d.request_id, []).extend(d.token_ids or ())
                token_ts.setdefault(d.request_id, []).append(d.ts)
        elif e.type == "terminal":
            ends[e.request_id] = (e.reason.value, e.ts)
    tokenizer = read_tokenizer(model_source(None).path)  # the default model's, as served
    print(f"\nevery request, from {path}:")
    for rid, a in admitted.items():
        prompt = tokenizer.decode(a.prompt_token_ids or ())
        job = next((j for words, j in JOBS.items() if words in prompt), "answer")
        if a.origin != "client":  # the engine's own prefill of the chat's next turn
            job = "next-turn"
        reason, end_ts = ends.get(rid, ("(none)", float("nan")))
        ts = token_ts.get(rid, [])
        out = tokens.get(rid, [])
        p = a.params
        print(
            f"  {rid[:22]:22} {job:10} prompt {a.num_prompt_tokens:5d}, max_tokens "
            f"{p.max_tokens:5d}{' guarded' if p.loop_guard else ''}, rep "
            f"{p.repetition_penalty:g}, T {p.temperature:g}; out "
            f"{len(out):5d}, {reason:9}; queueing {first_step.get(rid, a.ts) - a.ts:6.2f} s, "
            f"TTFT {(ts[0] - a.ts) if ts else float('nan'):6.2f} s, took {end_ts - a.ts:6.1f} s"
        )
        if job not in ("answer", "next-turn"):
            print(f"      its text ends: {tokenizer.decode(out)[-160:]!r}")


async def main(args: argparse.Namespace, url: str) -> None:
    from test_open_webui import OLLAMA_MODEL, OPENAI_MODEL, running_open_webui

    if args.open_webui:
        os.environ["STEPLINE_OPEN_WEBUI"] = args.open_webui
    with anyio.fail_after(600):
        while True:
            try:
                async with httpx.AsyncClient(timeout=5) as http:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            await anyio.sleep(0.5)
    with tempfile.TemporaryDirectory(prefix="open-webui-bench-") as data:
        async with running_open_webui(Server(url), Path(data)) as webui:  # type: ignore[arg-type]
            for model in (OPENAI_MODEL, OLLAMA_MODEL):
                took, jobs = [], []
                for question in QUESTIONS[: args.questions]:
                    a, n, j, title = await one(webui, model, question)
                    took.append(a)
                    jobs.append(j)
                    print(
                        f"{model:30} {question[:32]:32} answer {a:6.1f} s ({n:4d} chars), "
                        f"title and follow-ups {j:5.1f} s after it (title {title[:30]!r})",
                        flush=True,
                    )
                print(
                    f"{model:30} median: answer {statistics.median(took):.1f} s, title and"
                    f" follow-ups {statistics.median(jobs):.1f} s after it"
                    f" (max {max(jobs):.1f})",
                    flush=True,
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--open-webui", help="the open-webui executable (default: .venv-openwebui)")
    parser.add_argument(
        "--event-log", type=Path, help="the server's event log (then a report of each request)"
    )
    args = parser.parse_args()
    from test_open_webui import free_port

    port = free_port()
    with (Path(tempfile.gettempdir()) / "open-webui-bench-stepline.log").open("wb") as log:
        argv = [str(ROOT / ".venv" / "bin" / "stepline"), "serve", "--port", str(port)]
        if args.event_log is not None:  # the only flag: every default stays as a user has it
            args.event_log.unlink(missing_ok=True)
            argv += ["--event-log", str(args.event_log)]
        # the default model, every default, as a user starts it
        serve = subprocess.Popen(argv, stdout=log, stderr=log)
        try:
            anyio.run(main, args, f"http://127.0.0.1:{port}")
        finally:
            serve.terminate()
            serve.wait(30)
    if args.event_log is not None:
        report(args.event_log)
