"""The built-in demo models, and loading models by name, path or Hugging Face id."""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from stepline.engine import models
from stepline.engine.models import (
    DEMO_MODELS,
    LoadedModel,
    ModelNotFoundError,
    demo_model_path,
    load_model,
)

SMALL_DEMOS = ["demo", "demo_hybrid", "demo_sliding"]  # fixture names (tests/conftest.py)
PROMPT = "The lighthouse keeper climbed the steps and"


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("fixture", SMALL_DEMOS)
def test_each_demo_model_loads_through_mlx_lm_and_generates_text(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    loaded: LoadedModel = request.getfixturevalue(fixture)

    text = mlx_lm.generate(loaded.model, loaded.tokenizer, PROMPT, max_tokens=8)

    assert text
    assert loaded.name in DEMO_MODELS
    assert loaded.max_context == 2048
    assert isinstance(loaded.tokenizer.detokenizer, BPEStreamingDetokenizer)


@pytest.mark.parametrize("fixture", SMALL_DEMOS)
def test_greedy_generation_runs_on_with_varied_tokens_instead_of_stopping(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    loaded: LoadedModel = request.getfixturevalue(fixture)
    chat = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True
    )

    for prompt in (PROMPT, chat):
        tokens = [
            r.token for r in mlx_lm.stream_generate(loaded.model, loaded.tokenizer, prompt, 40)
        ]
        assert len(tokens) == 40
        assert not set(tokens) & loaded.tokenizer.eos_token_ids
        assert len(set(tokens)) >= 8


def test_demo_directory_has_the_standard_mlx_lm_layout(demo: LoadedModel) -> None:
    names = {p.name for p in demo.path.iterdir()}

    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((demo.path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == len(demo.tokenizer) == 1024
    tokenizer_config = json.loads((demo.path / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_demo_is_built_under_the_cache_dir_and_reused(model_cache_dir: Path) -> None:
    path = demo_model_path("stepline-demo")
    built_at = (path / "model.safetensors").stat().st_mtime_ns

    again = demo_model_path("stepline-demo")

    assert path.parent == model_cache_dir / "models"
    assert path.name.startswith("stepline-demo-")
    assert again == path
    assert (again / "model.safetensors").stat().st_mtime_ns == built_at


@pytest.mark.parametrize("name", ["stepline-demo", "stepline-demo-hybrid", "stepline-demo-sliding"])
def test_building_a_demo_twice_gives_identical_bytes(name: str, tmp_path: Path) -> None:
    first = demo_model_path(name, cache_dir=tmp_path / "a")
    second = demo_model_path(name, cache_dir=tmp_path / "b")

    assert first.name == second.name
    assert _files(first) == _files(second)


def test_a_build_that_loses_the_race_uses_the_winners_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = models._build

    def build_while_another_process_finishes_first(spec, out: Path) -> None:
        real_build(spec, out)
        winner = out.parent / f"stepline-demo-{models._spec_hash(spec)}"
        real_build(spec, winner)

    monkeypatch.setattr(models, "_build", build_while_another_process_finishes_first)

    path = demo_model_path("stepline-demo", cache_dir=tmp_path)

    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]
    assert (path / "config.json").is_file()


def test_hybrid_demo_has_both_recurrent_and_attention_caches(demo_hybrid: LoadedModel) -> None:
    kinds = {type(c) for c in make_prompt_cache(demo_hybrid.model)}

    assert kinds == {ArraysCache, KVCache}


def test_sliding_demo_has_rotating_caches_and_generates_past_its_window(
    demo_sliding: LoadedModel,
) -> None:
    caches = make_prompt_cache(demo_sliding.model)
    long_prompt = " ".join(["word"] * 40)

    text = mlx_lm.generate(demo_sliding.model, demo_sliding.tokenizer, long_prompt, max_tokens=20)

    assert any(isinstance(c, RotatingKVCache) for c in caches)
    assert {c.max_size for c in caches if isinstance(c, RotatingKVCache)} == {16}
    assert text


def test_chat_template_renders_a_system_and_user_turn_with_a_generation_prompt(
    demo: LoadedModel,
) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ]

    rendered = demo.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )

    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_special_tokens_encode_as_single_tokens(demo: LoadedModel) -> None:
    tokenizer = demo.tokenizer

    ids = tokenizer.encode("<|im_start|>user\nhello<|im_end|>")

    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces, trailing spaces  ",
        "tabs\tand\nnewlines\r\n",
        "naïve café, Ünïcödé",
        "日本語と中文",
        "emoji 🙂 and a family 👩‍👩‍👧",
        "e\u0301 combining accent",
    ],
)
def test_any_unicode_text_round_trips_through_encode_and_decode(
    demo: LoadedModel, text: str
) -> None:
    assert demo.tokenizer.decode(demo.tokenizer.encode(text)) == text


def test_an_emoji_spans_several_tokens_and_streams_out_whole(demo: LoadedModel) -> None:
    tokenizer = demo.tokenizer
    ids = tokenizer.encode("a🙂b")
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()

    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)

    assert len(tokenizer.encode("🙂")) > 1
    assert "".join(segments) == "a🙂b"
    assert not any("\ufffd" in s for s in segments)


def test_a_local_directory_loads_by_path(demo: LoadedModel) -> None:
    loaded = load_model(str(demo.path))

    assert loaded.path == demo.path
    assert loaded.name == str(demo.path)
    assert loaded.max_context == demo.max_context


def test_an_unknown_hugging_face_id_offline_says_what_was_tried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)

    with pytest.raises(ModelNotFoundError) as error:
        load_model("no/such-model-xyz")

    message = str(error.value)
    assert f"local path {tmp_path / 'no' / 'such-model-xyz'} (not found)" in message
    assert "Hugging Face id 'no/such-model-xyz'" in message
    assert "HF_HUB_OFFLINE" in message


def test_a_missing_local_directory_raises_model_not_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)

    with pytest.raises(ModelNotFoundError, match="missing_dir"):
        load_model("./missing_dir")


def test_a_directory_without_a_config_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_an_unknown_demo_name_lists_the_demo_models(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="stepline-demo-hybrid"):
        demo_model_path("stepline-demo-nope", cache_dir=tmp_path)


def test_large_demo_builds_in_seconds_and_generates(model_cache_dir: Path) -> None:
    started = time.perf_counter()
    loaded = load_model("stepline-demo-large")
    elapsed = time.perf_counter() - started

    text = mlx_lm.generate(loaded.model, loaded.tokenizer, PROMPT, max_tokens=4)

    assert loaded.max_context == 8192
    assert text
    assert elapsed < 30  # generous: about 1 s on 2 CPU cores


def test_demo_template_renders_tools_tool_calls_and_tool_responses_like_qwen3(
    demo: LoadedModel,
) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]

    rendered = demo.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )

    assert rendered.startswith("<|im_start|>system\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    assert rendered.endswith(
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_mlx_lm_finds_the_demo_models_tool_parser_and_think_tags(demo: LoadedModel) -> None:
    tokenizer = demo.tokenizer

    assert tokenizer.init_kwargs["tool_parser_type"] == "json_tools"
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    # Markup tokens are one token each and decode as text, as in Qwen3.
    ids = tokenizer.encode("<think>x</think>", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<think>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_thinking_off_closes_an_empty_think_block_after_the_generation_prompt(
    demo: LoadedModel,
) -> None:
    rendered = demo.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )

    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_request_actors_stream_is_the_tokenizers_own_decode(demo: LoadedModel) -> None:
    """Request actors stream with `detokenizers`: the Rust tokenizer's incremental decoder
    where the tokenizer's own `decode` is the Rust one, and what they stream, joined, is
    that `decode` (special tokens, byte tokens that are half a character, an output that
    ends mid-character included); any other tokenizer streams over its own `decode`."""
    import copy
    import random

    from stepline.actors.request import IncrementalDetokenizer, StreamDetokenizer
    from stepline.api.prompts import detokenizers

    tokenizer = demo.tokenizer
    new = detokenizers(tokenizer)
    assert isinstance(new(), StreamDetokenizer)  # the demo's tokenizer takes the short path
    rng = random.Random(0)
    vocab = len(tokenizer)
    text = tokenizer.encode("a🙂b héllo 世界", add_special_tokens=False)
    outputs = [[], text, text[:2], [0, 1, 2, 5]]
    outputs += [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    for ids in outputs:
        detok = new()
        pieces = [detok.add(t) for t in ids]
        assert "".join(pieces) + detok.finalize() == tokenizer.decode(ids), ids
    detok = new()
    assert [detok.add(t) for t in text][1:3] == ["", ""]  # the emoji's first bytes wait

    # Wrapped the way mlx-lm wraps it: plain, the short path; cleaning up spaces, its own.
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = copy.deepcopy(tokenizer._tokenizer)
    assert isinstance(detokenizers(TokenizerWrapper(hf))(), StreamDetokenizer)
    hf.clean_up_tokenization_spaces = True
    assert isinstance(detokenizers(TokenizerWrapper(hf))(), IncrementalDetokenizer)
