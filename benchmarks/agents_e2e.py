"""Claude Code and Codex against `stepline serve`: the real CLIs as an acceptance check.

Installs `@anthropic-ai/claude-code` and `@openai/codex` from npm (into `--npm-prefix`; when
npm skipped Claude Code's postinstall, runs its `install.cjs`), starts `stepline serve` on
127.0.0.1, runs each CLI for one short task configured with nothing but the base URL, a key
and the model name, and reports every request the server answered with a non-2xx status
(from its access log, with the error it gave). Exit status 1 if any was non-2xx.

    python benchmarks/agents_e2e.py                      # the demo model, given a long context
    python benchmarks/agents_e2e.py --model PATH --served-model-name NAME

The demo model's context (2,048 tokens) is shorter than the CLIs' system prompts (Claude Code
with `--tools Bash`: ~4,900 tokens of the demo's small vocabulary), so by default the script
serves a copy of it whose config allows a long context (`--context`; random weights and RoPE:
any length runs). Its answers are gibberish; a turn ends at an end-of-text token or at its
token limit (`--max-kv-tokens` bounds that: Claude Code asks for 32,000). What is checked is
that every request a CLI sends gets a 2xx.

Not a test (it needs npm and a few minutes); see "Claude Code and Codex" in docs/agents.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ACCESS = re.compile(r'"(GET|POST|HEAD|DELETE|PUT|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


def install(prefix: Path) -> dict[str, Path]:
    """The two CLIs' executables, installed under `prefix` if they are not there yet."""
    bins = {
        "claude": prefix / "node_modules/.bin/claude",
        "codex": prefix / "node_modules/.bin/codex",
    }
    if not all(b.exists() for b in bins.values()):
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(prefix),
                "@anthropic-ai/claude-code",
                "@openai/codex",
            ],
            check=True,
        )
    if subprocess.run([bins["claude"], "--version"], capture_output=True).returncode != 0:
        # npm may skip install scripts: Claude Code's fetches its native binary.
        package = prefix / "node_modules/@anthropic-ai/claude-code"
        subprocess.run(["node", "install.cjs"], cwd=package, check=True)
    for name, path in bins.items():
        version = subprocess.run([path, "--version"], capture_output=True, text=True)
        print(f"{name}: {version.stdout.strip() or version.stderr.strip()}")
    return bins


def long_context_demo(context: int) -> Path:
    """A copy of the demo model whose config allows `context` tokens."""
    import stepline.engine  # noqa: F401 - OpenBLAS before MLX
    from stepline.engine.models import demo_model_path

    source = demo_model_path("stepline-demo")
    target = Path(tempfile.mkdtemp(prefix="stepline-demo-long-")) / "stepline-demo"
    shutil.copytree(source, target)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = target / name
        config = json.loads(path.read_text())
        config[key] = context
        path.write_text(json.dumps(config))
    return target


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"stepline serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("stepline serve did not become healthy")


def run_cli(name: str, cmd: list[str], env: dict[str, str], timeout_s: float) -> None:
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        status = f"exit {done.returncode}"
        out = (done.stdout + done.stderr).strip()
    except subprocess.TimeoutExpired as exc:
        status = f"stopped after {timeout_s:g} s"
        out = (
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else exc.stdout or ""
        )
    print(f"\n== {name}: {status} in {time.monotonic() - t0:.0f} s")
    print("   " + "\n   ".join(out.splitlines()[-8:]))


def requests_seen(log_text: str, since: int) -> list[tuple[str, str, int, str]]:
    """(method, path, status, error) of each request in the server log after offset `since`;
    `error` is the request's `request_error` line, for a non-2xx."""
    seen: list[tuple[str, str, int, str]] = []
    errors: dict[str, str] = {}
    for line in log_text[since:].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        event = str(record.get("event", ""))
        rid = str(record.get("request_id", ""))
        if event == "request_error":
            errors[rid] = f"{record.get('code')}: {record.get('message') or record.get('route')}"
        match = ACCESS.search(event)
        if match:
            method, path, status = match.groups()
            seen.append((method, path, int(status), errors.get(rid, "")))
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model to serve (default: the demo model, long context)")
    p.add_argument("--served-model-name", default="stepline-demo")
    p.add_argument("--context", type=int, default=32768, help="the demo copy's context")
    p.add_argument("--max-kv-tokens", type=int, default=24000)
    p.add_argument("--npm-prefix", type=Path, default=Path.home() / ".cache/stepline/agents-npm")
    p.add_argument("--timeout", type=float, default=240, help="seconds per CLI")
    p.add_argument("--task", default="say hi")
    args = p.parse_args()
    if shutil.which("npm") is None:
        print("npm is not installed: nothing to run (install Node.js and npm)")
        return 0
    bins = install(args.npm_prefix)
    model = args.model or str(long_context_demo(args.context))
    name = args.served_model_name
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    key = "sk-agents-e2e"
    log_file = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    serve = [
        sys.executable, "-m", "stepline.api.cli", "serve", "--model", model,
        "--served-model-name", name, "--port", str(port), "--api-key", key,
        "--log-format", "json", "--max-kv-tokens", str(args.max_kv_tokens),
    ]  # fmt: skip
    server = subprocess.Popen(serve, stdout=log_file, stderr=subprocess.STDOUT)
    home = Path(tempfile.mkdtemp(prefix="agents-e2e-home-"))  # the CLIs' config, not yours
    failures = 0
    try:
        wait_healthy(url, server)
        base_env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb"}
        clis = {
            "Claude Code": (
                [str(bins["claude"]), "-p", args.task, "--model", name, "--tools", "Bash"],
                {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key},
            ),
            "Codex": (
                [
                    str(bins["codex"]),
                    "exec",
                    "--skip-git-repo-check",
                    "-c",
                    "model_provider=stepline",
                    "-c",
                    f'model_providers.stepline={{name="stepline",base_url="{url}/v1",'
                    'wire_api="responses",env_key="STEPLINE_API_KEY"}',
                    "-m",
                    name,
                    args.task,
                ],  # fmt: skip
                {"STEPLINE_API_KEY": key, "CODEX_HOME": str(home / ".codex")},
            ),
        }
        (home / ".codex").mkdir()
        for cli, (cmd, env) in clis.items():
            log_file.flush()
            since = len(Path(log_file.name).read_text())
            run_cli(cli, cmd, {**base_env, **env}, args.timeout)
            time.sleep(0.5)  # the last access line
            seen = requests_seen(Path(log_file.name).read_text(), since)
            bad = [s for s in seen if not 200 <= s[2] < 300]
            failures += len(bad)
            print(f"   the server answered {len(seen)} requests, {len(bad)} non-2xx")
            for method, path, status, error in seen:
                mark = "  " if 200 <= status < 300 else "!!"
                print(f"   {mark} {status} {method} {path}  {error}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        print(f"\nserver log: {log_file.name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
