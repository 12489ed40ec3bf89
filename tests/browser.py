"""Headless Chromium driven over the DevTools protocol: the browser the page tests use
(Debian's `chromium`)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from helpers import until_async

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium)"
)


class Page:
    """A page of headless Chromium, driven over the DevTools protocol."""

    def __init__(self, ws: Any):
        self.ws = ws
        self._id = 0

    async def call(self, method: str, **params: Any) -> dict:
        self._id += 1
        await self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # events of the page come in between: not ours
            reply = json.loads(await self.ws.recv())
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def shows(self, expression: str, *, within: float = 10, what: str) -> Any:
        """The first true value of `expression` in the page (asked every 50 ms: what a
        browser in another process draws, nothing here can await)."""

        async def check() -> Any:
            return await self.evaluate(expression)

        return await until_async(check, within=within, what=what)


@asynccontextmanager
async def chromium_page(url: str) -> AsyncIterator[Page]:
    """`url` open in headless Chromium (its own profile, gone afterwards)."""
    import websockets

    assert CHROMIUM is not None
    # Chromium's helper processes may still write to the profile as it goes
    with tempfile.TemporaryDirectory(
        prefix="stepline-chromium-", ignore_cleanup_errors=True
    ) as profile:
        argv = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # as root (a container): Chromium's sandbox will not start
            "--disable-gpu",
            "--no-first-run",
            "--window-size=1400,1000",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        async with await anyio.open_process(argv) as process:
            try:
                port_file = Path(profile) / "DevToolsActivePort"

                async def started() -> bool:
                    return port_file.exists() and bool(port_file.read_text().strip())

                await until_async(started, within=30, what="chromium's DevTools port")
                port = int(port_file.read_text().split()[0])
                async with httpx.AsyncClient() as http:
                    target = (await http.put(f"http://127.0.0.1:{port}/json/new?{url}")).json()
                async with websockets.connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
                    yield Page(ws)
            finally:
                process.terminate()
