"""Defaults from the model (issue 54): a model directory's generation_config.json is the
default sampling of every door, under a request's own values and over the engine's; a request
that sets no cap ends at the default one. Real servers on 127.0.0.1 over a copy of the demo
model whose directory has a generation_config.json."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import pytest
import pytest_asyncio
from helpers import Served, hold_open, open_served, wait_finished

from stepline.api.config import read_models_file
from stepline.api.defaults import DEFAULT_MAX_TOKENS, SamplingDefaults, resolve

IN_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

# What Qwen3's generation_config.json recommends, and a small cap so tests are quick.
QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
MAX_NEW_TOKENS = 5
HI = [{"role": "user", "content": "Tell me about rye bread."}]


@pytest.fixture(scope="module")
def tuned_dir(demo, tmp_path_factory) -> Path:
    """The demo model's directory, copied, with a generation_config.json of its own."""
    path = tmp_path_factory.mktemp("tuned") / "tuned-demo"
    shutil.copytree(demo.path, path)
    config = {**QWEN3_LIKE, "max_new_tokens": MAX_NEW_TOKENS, "bos_token_id": 1}
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tuned(tuned_dir) -> AsyncIterator[Served]:
    """That model served three ways on one engine: as it comes, with --generation-config
    none ("none"), and with --default-max-tokens 3 ("capped")."""
    apps = {"none": {"generation_config": "none"}, "capped": {"default_max_tokens": 3}}
    value, close = await hold_open(open_served(str(tuned_dir), apps=apps))
    try:
        yield value
    finally:
        await close()


async def _params(served: Served, rid: str):
    return (await wait_finished(served.engine.step_loop, rid)).params


async def _chat(served: Served, url: str | None = None, **body):
    async with served.http(url) as http:
        r = await http.post(
            "/v1/chat/completions", json={"model": served.engine.model_name, "messages": HI, **body}
        )
    assert r.status_code == 200, r.text
    return r.json(), await _params(served, r.headers["x-request-id"])


@IN_MODULE_LOOP
async def test_a_chat_that_sets_nothing_samples_as_the_model_s_generation_config(tuned):
    body, params = await _chat(tuned, ignore_eos=True)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert params.repetition_penalty == 1.0 and params.min_p == 0.0  # the file sets neither
    assert body["usage"]["completion_tokens"] == MAX_NEW_TOKENS  # its max_new_tokens
    assert body["choices"][0]["finish_reason"] == "length"


@IN_MODULE_LOOP
async def test_a_request_s_own_values_beat_the_model_s(tuned):
    _, params = await _chat(tuned, temperature=0, top_k=3, max_tokens=2)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 3, 2)
    assert params.top_p == 0.95  # what it left out is still the model's


@IN_MODULE_LOOP
async def test_every_door_takes_the_model_s_defaults(tuned):
    model = tuned.engine.model_name
    async with anthropic.AsyncAnthropic(base_url=tuned.url, api_key="x") as client:
        raw = await client.messages.with_raw_response.create(model=model, max_tokens=2, messages=HI)
    messages = await _params(tuned, raw.headers["x-request-id"])
    async with tuned.http() as http:
        r = await http.post("/v1/responses", json={"model": model, "input": "Hi"})
        responses = await _params(tuned, r.headers["x-request-id"])
        r = await http.post("/api/chat", json={"model": model, "messages": HI, "stream": False})
        ollama = await _params(tuned, r.headers["x-request-id"])
    for params in (messages, responses, ollama):
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert responses.max_tokens == ollama.max_tokens == MAX_NEW_TOKENS
    # Ollama's own DefaultOptions fill what the model's file leaves out, as a Modelfile's
    # parameters are layered over them.
    assert ollama.repetition_penalty == 1.0


@IN_MODULE_LOOP
async def test_the_model_cards_report_the_defaults_in_effect(tuned):
    model = tuned.engine.model_name
    async with tuned.http() as http:
        card = (await http.get(f"/v1/models/{model}")).json()
    assert card["sampling_defaults"] == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": MAX_NEW_TOKENS,
        "source": "generation_config.json",
    }


@IN_MODULE_LOOP
async def test_ollamas_show_lists_the_model_s_parameters_over_ollamas_defaults(tuned):
    async with tuned.http() as http:
        shown = (await http.post("/api/show", json={"model": tuned.engine.model_name})).json()
    parameters = dict(line.split(maxsplit=1) for line in shown["parameters"].splitlines())
    assert parameters == {
        "temperature": "0.6",
        "top_p": "0.95",
        "top_k": "20",
        "repeat_penalty": "1",  # Ollama's default: the model's file sets none
        "repeat_last_n": "64",  # Ollama's too
        "num_predict": str(MAX_NEW_TOKENS),
    }


@IN_MODULE_LOOP
async def test_generation_config_none_samples_as_the_engine_does(tuned):
    room = tuned.engine.max_context
    body, params = await _chat(tuned, tuned.urls["none"], max_tokens=1)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    async with tuned.http(tuned.urls["none"]) as http:
        card = (await http.get(f"/v1/models/{tuned.engine.model_name}")).json()
    assert card["sampling_defaults"] == {"max_tokens": DEFAULT_MAX_TOKENS, "source": "server"}
    assert room < DEFAULT_MAX_TOKENS  # the demo's 2048: a cap past the room is cut to it


@IN_MODULE_LOOP
async def test_a_request_with_no_max_tokens_ends_at_the_server_s_default_cap(tuned):
    body, params = await _chat(tuned, tuned.urls["capped"], ignore_eos=True)
    assert params.max_tokens == 3 and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    # A request asks for more itself.
    body, params = await _chat(tuned, tuned.urls["capped"], ignore_eos=True, max_tokens=7)
    assert body["usage"]["completion_tokens"] == 7


def test_the_layers_apply_in_order(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.7, "top_p": 2.0, "repetition_penalty": 1.05, "max_new_tokens": 9}
        )
    )
    read = resolve(tmp_path)
    # A value out of range in the model's file is left out, not fatal.
    assert read.sampling == SamplingDefaults(temperature=0.7, repetition_penalty=1.05)
    assert read.max_tokens == 9
    own = resolve(tmp_path, own=SamplingDefaults(temperature=0.2), server_max_tokens=100)
    assert own.sampling.temperature == 0.2 and own.sampling.repetition_penalty == 1.05
    assert own.max_tokens == 100 and own.source == "models file over generation_config.json"
    assert resolve(tmp_path, own_max_tokens=5, server_max_tokens=100).max_tokens == 5
    none = resolve(tmp_path, generation_config="none")
    assert none.sampling == SamplingDefaults() and none.max_tokens == DEFAULT_MAX_TOKENS
    assert resolve(tmp_path / "absent").source == "server"


def test_the_models_file_takes_a_model_s_defaults(tmp_path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[models.small]\nmodel = "stepline-demo"\ntemperature = 0.2\ntop_p = 0.9\n'
        'generation_config = "none"\ndefault_max_tokens = 512\nmax_step_tokens = 64\n'
    )
    [spec] = read_models_file(path)
    assert spec.sampling == SamplingDefaults(temperature=0.2, top_p=0.9)
    assert (spec.generation_config, spec.default_max_tokens) == ("none", 512)
    assert spec.options == {"max_step_tokens": 64}
    path.write_text('[models.small]\nmodel = "stepline-demo"\ntop_p = 0\n')
    with pytest.raises(ValueError, match=r"\[models.small\]: top_p: Input should be greater"):
        read_models_file(path)
