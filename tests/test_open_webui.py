"""A real Open WebUI against a real stepline server, in headless Chromium, as a new user meets
it: the default model (SmolLM2) through the OpenAI and the Ollama doors at once.

Open WebUI pins its own openai and fastapi, so it lives in a venv of its own
(`.venv-openwebui`, or $STEPLINE_OPEN_WEBUI naming its `open-webui` executable) and these
tests are left out of the default run: `pytest -m open_webui` runs them (the README's second
test command, which CI runs too). Open WebUI runs offline (no model hub, no update check) in a
data folder of its own, with no login (`WEBUI_AUTH=False`: the page signs in as its admin)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import pytest_asyncio
from browser import CHROMIUM, Page, chromium_page
from helpers import Served, hold_open, open_served, until_async, wait_finished, wait_until

pytestmark = [
    pytest.mark.open_webui,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),  # a real model on 2 cores, answers and their background jobs
]

REPO = Path(__file__).resolve().parent.parent
OPENAI_MODEL = "SmolLM2-135M-Instruct"  # the OpenAI door's model, as /v1/models lists it
OLLAMA_MODEL = "SmolLM2-135M-Instruct:latest"  # the Ollama door's, as /api/tags lists it
DOORS = {OPENAI_MODEL: "chatcmpl-", OLLAMA_MODEL: "ollama-"}  # model -> its request ids
# What each Open WebUI job may take on CI's 2 cores: the answer, then its title and
# follow-ups (the target, 30 s on this CPU, is measured by benchmarks/open_webui.py).
WITHIN_S = 300
ANSWER_CAP = 200  # the server's --default-max-tokens here: an answer that sets none ends by it


def open_webui_executable() -> Path:
    named = os.environ.get("STEPLINE_OPEN_WEBUI")
    path = Path(named) if named else REPO / ".venv-openwebui" / "bin" / "open-webui"
    if not path.is_file():
        pytest.fail(
            f"no Open WebUI at {path}: python3 -m venv .venv-openwebui && "
            ".venv-openwebui/bin/pip install -q open-webui==0.12.4 (see the README)"
        )
    if CHROMIUM is None:
        pytest.fail("no chromium binary (Debian: apt-get install chromium)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stepline(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    """The default model behind a real server, with every default as `stepline serve` has
    them but the answers' cap (a user's answer ends by itself at the model's end of turn or
    this cap: 200 tokens keep a test's answer, title and follow-ups to a few minutes)."""
    log = tmp_path_factory.mktemp("open-webui-stepline") / "events.jsonl"
    served, close = await hold_open(
        open_served(
            OPENAI_MODEL,  # by its name, as `stepline serve` serves it (the fixture built it)
            engine={"max_step_tokens": 512},
            event_log=log,
            default_max_tokens=ANSWER_CAP,
        )
    )
    try:
        yield served
    finally:
        await close()


@asynccontextmanager
async def running_open_webui(stepline: Served, data: Path) -> AsyncIterator[str]:
    """Open WebUI serving `stepline` through both of its doors, from `data`; its URL."""
    executable = open_webui_executable()
    port = free_port()
    env = {
        **os.environ,
        "DATA_DIR": str(data),
        "WEBUI_AUTH": "False",
        "OFFLINE_MODE": "true",  # no model hub, no update check, no pip at run time
        "HF_HUB_OFFLINE": "1",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",  # no local embedding model to load
        "ENABLE_OPENAI_API": "true",
        "OPENAI_API_BASE_URL": f"{stepline.url}/v1",
        "OPENAI_API_KEY": "unused",
        "ENABLE_OLLAMA_API": "true",
        "OLLAMA_BASE_URL": stepline.url,
        "ENABLE_VERSION_UPDATE_CHECK": "false",
    }
    argv = [str(executable), "serve", "--host", "127.0.0.1", "--port", str(port)]
    log = data / "open-webui.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        opened = anyio.open_process(argv, env=env, stdout=out, stderr=out, cwd=data)
        async with await opened as process:  # its own files (a secret key) go to `data`
            try:

                async def up() -> bool:
                    if process.returncode is not None:
                        raise AssertionError(f"Open WebUI exited: {log.read_text()[-3000:]}")
                    try:
                        async with httpx.AsyncClient(timeout=5) as http:
                            return (await http.get(f"{url}/health")).status_code == 200
                    except httpx.HTTPError:
                        return False

                await until_async(up, within=WITHIN_S, what="Open WebUI's /health", every=0.5)
                yield url
            finally:
                process.terminate()
                with anyio.move_on_after(20):
                    await process.wait()
                if process.returncode is None:
                    process.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def webui(stepline: Served, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """Open WebUI's URL, one for the module."""
    data = tmp_path_factory.mktemp("open-webui-data")
    url, close = await hold_open(running_open_webui(stepline, data))
    try:
        yield url
    finally:
        await close()


async def fetch_json(page: Page, path: str) -> Any:
    """`path` of Open WebUI's API, fetched by the page with its own sign-in."""
    got = await page.call(
        "Runtime.evaluate",
        expression=(
            f"fetch({json.dumps(path)}, {{headers: {{Authorization: "
            "'Bearer ' + localStorage.token}}).then((r) => r.json())"
        ),
        awaitPromise=True,
        returnByValue=True,
    )
    return got["result"].get("value")


async def click_button(page: Page, *, text: str | None = None, label: str | None = None) -> bool:
    """Click the page's first button showing `text` or labelled `label`; False if none."""
    test = (
        f"b.textContent.trim() === {json.dumps(text)}"
        if text is not None
        else f"b.getAttribute('aria-label') === {json.dumps(label)}"
    )
    return bool(
        await page.evaluate(
            f"(() => {{ const b = [...document.querySelectorAll('button')].find((b) => {test});"
            " if (b) b.click(); return !!b; })()"
        )
    )


async def new_chat(page: Page, model: str, message: str) -> str:
    """Send `message` to `model` from a new chat, as a user types it; the chat's id."""
    await page.shows(
        f"document.querySelector('#model-selector-model-button')?.textContent.trim() === "
        f"{json.dumps(model)}",
        within=60,
        what=f"{model} selected",
    )
    await click_button(page, text="Okay, Let's Go!")  # the release notes, on a first visit
    await page.evaluate("document.getElementById('chat-input').focus()")
    await page.call("Input.insertText", text=message)
    await page.shows("!!document.getElementById('send-message-button')", what="the send button")
    await page.evaluate("document.getElementById('send-message-button').click()")
    return str(
        await page.shows(
            "location.pathname.startsWith('/c/') && location.pathname.slice(3)",
            within=60,
            what="the chat's page",
        )
    )


def answers(chat: dict[str, Any]) -> list[dict[str, Any]]:
    messages = chat["chat"]["history"]["messages"].values()
    return [m for m in messages if m["role"] == "assistant"]


def ours(served: Served, prefix: str, since: set[str]) -> list[str]:
    """The ids of the requests of one door (`prefix`) not in `since`, oldest first."""
    loop = served.engine.step_loop
    every = [*loop.finished, *loop.states]
    return [rid for rid in every if rid.startswith(prefix) and rid not in since]


def seen(served: Served) -> set[str]:
    loop = served.engine.step_loop
    return {*loop.finished, *loop.states}


async def test_open_webui_lists_the_model_through_both_doors(stepline: Served, webui: str) -> None:
    async with chromium_page(f"{webui}/") as page:
        await page.shows("!!document.getElementById('chat-input')", within=120, what="the chat")
        models = await fetch_json(page, "/api/models")
    got = {m["id"]: m.get("owned_by") for m in models["data"]}
    assert got == {OPENAI_MODEL: "openai", OLLAMA_MODEL: "ollama"}, got


@pytest.mark.parametrize("model", [OPENAI_MODEL, OLLAMA_MODEL])
async def test_an_answer_streams_and_ends_and_so_do_its_title_and_follow_ups(
    stepline: Served, webui: str, model: str
) -> None:
    before = seen(stepline)
    async with chromium_page(f"{webui}/?model={model}") as page:
        sent = time.monotonic()
        chat_id = await new_chat(page, model, "What is the capital of France?")

        async def streaming() -> str:  # the answer's text, drawn as it comes
            chat = await fetch_json(page, f"/api/v1/chats/{chat_id}")
            [answer] = answers(chat)
            return str(answer.get("content") or "")

        first_words = await until_async(streaming, within=WITHIN_S, what="the answer's text")

        async def ended() -> dict[str, Any] | None:
            chat = await fetch_json(page, f"/api/v1/chats/{chat_id}")
            [answer] = answers(chat)
            return answer if answer.get("done") else None

        answer = await until_async(ended, within=WITHIN_S, what="the answer's end, unstopped")
        answered = time.monotonic()

        async def titled() -> dict[str, Any] | None:
            chat = await fetch_json(page, f"/api/v1/chats/{chat_id}")
            [done] = answers(chat)
            followed = done.get("followUps") is not None
            return chat if chat["title"] != "New Chat" and followed else None

        chat = await until_async(titled, within=WITHIN_S, what="the title and the follow-ups")
        shown = await page.evaluate("document.getElementById('messages-container').innerText")
    # every request Open WebUI sent ended by itself on the server: answer, title, follow-ups
    prefix = DOORS[model]
    rids = ours(stepline, prefix, before)
    assert len(rids) >= 2, rids  # the answer and at least the title's
    loop = stepline.engine.step_loop
    for rid in rids:
        state = await wait_finished(loop, rid, within=WITHIN_S)
        assert state.finish_reason in ("stop", "length"), (rid, state.finish_reason)
    # the page drew what the server made, streamed (text before the end)
    assert first_words and answer["content"].startswith(first_words[:10])
    assert (
        answer["content"].strip()[:40] in shown.replace("\n", " ")
        or answer["content"].strip().split()[0] in shown
    )
    print(
        f"\n{model}: answer {answered - sent:.1f} s ({len(answer['content'])} chars), title "
        f"and follow-ups {time.monotonic() - answered:.1f} s after it; title "
        f"{chat['title']!r}",
        file=sys.stderr,
    )


@pytest.mark.parametrize("model", [OPENAI_MODEL, OLLAMA_MODEL])
async def test_stop_in_the_page_cancels_the_answer_on_the_server(
    stepline: Served, webui: str, model: str
) -> None:
    before = seen(stepline)
    loop = stepline.engine.step_loop
    prefix = DOORS[model]
    async with chromium_page(f"{webui}/?model={model}") as page:
        chat_id = await new_chat(
            page, model, "Write a long story about a dragon and a knight, in many chapters."
        )

        def answering() -> str | None:  # the answer, some tokens out
            for rid in ours(stepline, prefix, before):
                state = loop.states.get(rid)
                # the answer sets no max_tokens (so it has the server's cap); the title job
                # beside it asks for Open WebUI's 1,000
                if state is not None and state.params.max_tokens == ANSWER_CAP:
                    return rid if state.num_output_tokens >= 3 else None
            return None

        # the step loop's own turns, not a poll: its state changes only as it steps
        await wait_until(loop, lambda: answering() is not None, within=WITHIN_S)
        rid = answering()
        assert rid is not None

        async def drawn() -> bool:  # Open WebUI's server has it as its task: Stop can end it
            [answer] = answers(await fetch_json(page, f"/api/v1/chats/{chat_id}"))
            return bool(answer.get("content"))

        await until_async(drawn, within=WITHIN_S, what="the answer's first words")
        assert await page.shows(
            "!!document.querySelector('button[aria-label=\"Stop\"]')", what="the Stop button"
        )
        clicked = time.monotonic()
        assert await click_button(page, label="Stop")
        tokens_at_click = loop.states[rid].num_output_tokens if rid in loop.states else None
        try:
            state = await wait_finished(loop, rid, within=60)
        except TimeoutError:
            live = {r: (st.num_output_tokens, st.finish_reason) for r, st in loop.states.items()}
            raise AssertionError(f"{rid} not ended 60 s after Stop: {live}") from None
        stopped = time.monotonic() - clicked
    assert state.finish_reason == "cancelled", (state.finish_reason, tokens_at_click)
    assert state.num_output_tokens < ANSWER_CAP  # stopped, not run to its cap
    print(
        f"\n{model}: Stop ended the request on the server {stopped:.2f} s after the click",
        file=sys.stderr,
    )
