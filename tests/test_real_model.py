"""The default model is a real instruct model: it answers, and served concurrently in
64-token chunks it gives exactly mlx-lm's own greedy tokens, in the engine and over HTTP."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import mlx.core as mx
import openai
import pytest
from helpers import mlx_lm_greedy, until

from stepline.api import Engine, SamplingParams
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel
from stepline.engine.default_model import DEFAULT_MODEL
from stepline.engine.models import load_model

MAX_TOKENS = 12
LONG_SYSTEM = "You are a careful assistant for a bakery. " + " ".join(
    f"Rule {i}: answer politely and mention bread number {i}." for i in range(14)
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Name another one, and say what colour it is."},
    ],
    [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "Which bread do you recommend for breakfast?"},
    ],
]


@pytest.fixture(scope="module")
def expected(smollm2) -> list[list[int]]:
    """mlx-lm's own greedy answer to each chat, cut at the model's end of turn."""
    template = smollm2.tokenizer.apply_chat_template
    stop = smollm2.tokenizer.eos_token_ids
    return [
        mlx_lm_greedy(smollm2.model, template(chat, add_generation_prompt=True), MAX_TOKENS, stop)
        for chat in CHATS
    ]


def test_the_prompts_are_long_enough_to_be_chunked(smollm2):
    lengths = [
        len(smollm2.tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS
    ]
    assert max(lengths) > 3 * 64 and min(lengths) < 64


async def test_the_default_model_knows_the_capital_of_france(smollm2):
    async with Engine.open(max_step_tokens=64) as engine:
        assert engine.model_name == DEFAULT_MODEL
        stream = await engine.submit(
            messages=CHATS[0], params=SamplingParams(max_tokens=24, temperature=0)
        )
        text = "".join([out.text async for out in stream])
    assert "Paris" in text


async def test_concurrent_chats_in_64_token_steps_give_mlx_lms_greedy_tokens(smollm2, expected):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    results: list[list[int]] = [[] for _ in CHATS]
    async with Engine.open(DEFAULT_MODEL, max_step_tokens=64) as engine:

        async def chat(i: int) -> None:
            stream = await engine.submit(messages=CHATS[i], params=params)
            async for out in stream:
                results[i].extend(out.token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(len(CHATS)):
                tg.start_soon(chat, i)
    eos = smollm2.tokenizer.eos_token_ids
    assert [[t for t in r if t not in eos] for r in results] == expected


async def test_the_http_server_streams_mlx_lms_greedy_text_to_concurrent_clients(smollm2, expected):
    texts: list[str] = ["" for _ in CHATS]
    async with (
        Engine.open(DEFAULT_MODEL, max_step_tokens=64) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
    ):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def chat(i: int) -> None:
            stream = await client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=CHATS[i],
                max_tokens=MAX_TOKENS,
                temperature=0,
                # the default model's own repetition penalty (its generation_config.json)
                # applies to what a request leaves out; mlx-lm's greedy text has none
                extra_body={"repetition_penalty": 1.0},
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    texts[i] += chunk.choices[0].delta.content

        async with anyio.create_task_group() as tg:
            for i in range(len(CHATS)):
                tg.start_soon(chat, i)
        await client.close()
    assert texts == [smollm2.tokenizer.decode(tokens) for tokens in expected]


def test_kept_quantized_and_dequantized_weights_give_the_same_logits(smollm2):
    kept = load_model(DEFAULT_MODEL, dtype="keep")
    assert kept.weights.startswith("4/8-bit quantized")
    assert smollm2.weights.startswith("float32 (dequantized from 4/8-bit quantized")
    # A short prompt: MLX runs 4-bit matmuls ~17x slower than float32 on the CPU backend.
    prompt = mx.array(smollm2.tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True))
    ours = smollm2.model(prompt[None])[0]
    theirs = kept.model(prompt[None])[0].astype(mx.float32)
    # The same numbers; only the order of float32 sums inside the matmuls differs.
    assert mx.allclose(ours, theirs, atol=0.1, rtol=0)
    assert mx.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_second_load_reads_the_converted_model_from_the_cache(smollm2):
    again = load_model(DEFAULT_MODEL)
    assert again.path == smollm2.path
    prompt = mx.array(smollm2.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True))
    assert mx.array_equal(again.model(prompt[None]), smollm2.model(prompt[None]))


def test_the_first_command_of_the_readme_serves_real_text(smollm2, tmp_path):
    """`stepline serve` with no --model: the default model, and a greedy answer that is right."""
    stepline = str(Path(sys.executable).with_name("stepline"))
    out = tmp_path / "serve.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [stepline, "serve", "--port", "0"], stdout=sink, stderr=subprocess.STDOUT
        )
    try:

        def serving() -> bool:
            assert proc.poll() is None, out.read_text()
            return "stepline: serving" in out.read_text()

        until(serving, within=120, what="stepline serve serving")
        printed = out.read_text()
        url = re.search(r"(http://127\.0\.0\.1:\d+)/health answers 503", printed).group(1)
        assert "loading SmolLM2-135M-Instruct, the default model" in printed
        assert "weights float32 (dequantized from 4/8-bit quantized" in printed
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": DEFAULT_MODEL, "messages": CHATS[0], "max_tokens": 16, "temperature": 0},
            timeout=60,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


async def test_an_agent_that_always_sends_tools_gets_its_answer_from_a_model_without_them(
    smollm2,
):
    """Claude Code and Codex send their tools with every request; SmolLM2's chat template has
    no tool format. The tools are left out and named, and the turn ends in text."""
    import anthropic

    bash = {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
    async with (
        Engine.open(DEFAULT_MODEL, max_step_tokens=64) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
    ):
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        raw = await client.messages.with_raw_response.create(
            model=DEFAULT_MODEL,
            max_tokens=16,
            extra_body={"temperature": 0},  # this SDK version has no temperature argument
            tools=[bash],
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        message = await raw.parse()
        forced = client.messages.create(
            model=DEFAULT_MODEL,
            max_tokens=16,
            tools=[bash],
            tool_choice={"type": "tool", "name": "Bash"},
            messages=[{"role": "user", "content": "List the files."}],
        )
        with pytest.raises(anthropic.BadRequestError, match="no tool-call format"):
            await forced
        await client.close()
    assert raw.headers["x-stepline-dropped-tools"] == "Bash"
    assert message.stop_reason == "end_turn"
    assert "Paris" in message.content[0].text
