"""Open WebUI on the default model, as a new user meets it: issue 54's targets.

`stepline serve` with every default (SmolLM2-135M-Instruct, no flags) behind a real Open WebUI
(in its own venv: the README's Open WebUI command), driven in headless Chromium through the
OpenAI and the Ollama doors. For each question it prints how long the answer took to end by
itself (no Stop), its length, and how long after it Open WebUI's background jobs (the title
and the follow-up suggestions) took to end.

    .venv/bin/python benchmarks/open_webui.py [--questions 3] [--open-webui PATH]
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
    args = parser.parse_args()
    from test_open_webui import free_port

    port = free_port()
    with (Path(tempfile.gettempdir()) / "open-webui-bench-stepline.log").open("wb") as log:
        serve = subprocess.Popen(  # the default model, every default, as a user starts it
            [str(ROOT / ".venv" / "bin" / "stepline"), "serve", "--port", str(port)],
            stdout=log,
            stderr=log,
        )
        try:
            anyio.run(main, args, f"http://127.0.0.1:{port}")
        finally:
            serve.terminate()
            serve.wait(30)
