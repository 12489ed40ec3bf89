"""Grammar-constrained decoding in the engine: forced output parses, other rows are untouched."""

from __future__ import annotations

import json
import threading

import anyio
import jsonschema
import pytest
from helpers import FAILS_LATER, UNFOLLOWABLE

from stepline.actors.scheduler.work import GRAMMAR_FAILED
from stepline.api import Engine, SamplingParams
from stepline.engine import grammar as grammar_module
from stepline.engine.grammar import GrammarError, json_schema_grammar, markup, tool_call_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}


async def text_of(engine, params, prompt="hi"):
    outs = [
        o
        async for o in engine.generate(
            messages=[{"role": "user", "content": prompt}], params=params
        )
    ]
    return "".join(o.text for o in outs), outs[-1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_random_model_under_a_json_schema_writes_valid_json_and_stops(
    model_cache_dir, temperature
):
    params = SamplingParams(
        max_tokens=80, temperature=temperature, seed=3, grammar=json_schema_grammar(PERSON)
    )
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        text, last = await text_of(engine, params)
    jsonschema.validate(json.loads(text), PERSON)
    assert last.finish_reason == "stop"


async def test_a_forced_tool_call_names_one_of_the_tools_with_valid_arguments(model_cache_dir):
    args = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    }
    tools = [("get_weather", args), ("noop", {"type": "object", "additionalProperties": False})]
    params = SamplingParams(max_tokens=60, temperature=0)
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        start, end = (markup(engine.tokenizer, t) for t in ("<tool_call>", "</tool_call>"))
        assert start.startswith("<[")  # the demo tokenizer has it as one token, as Qwen3 does
        grammar = tool_call_grammar(tools, start=start, end=end, parallel=False)
        params = params.model_copy(update={"grammar": grammar})
        text, last = await text_of(engine, params)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] in ("get_weather", "noop")
    if call["name"] == "get_weather":
        jsonschema.validate(call["arguments"], args)
    assert last.finish_reason == "stop"


async def test_constrained_rows_leave_the_unconstrained_rows_of_a_batch_unchanged(
    model_cache_dir,
):
    free = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    forced = SamplingParams(
        max_tokens=40, temperature=0.8, seed=9, grammar=json_schema_grammar(PERSON)
    )
    async with Engine.open("stepline-demo", max_step_tokens=256, max_num_seqs=8) as engine:
        alone = [(await text_of(engine, p, prompt=f"story {i}"))[0] for i, p in enumerate(free)]
        together: dict[int, str] = {}

        async def run(i, params, prompt):
            together[i] = (await text_of(engine, params, prompt=prompt))[0]

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(free):
                tg.start_soon(run, i, p, f"story {i}")
            for j in range(3):
                tg.start_soon(run, 10 + j, forced, f"json {j}")
    assert [together[0], together[1]] == alone
    for j in range(3):
        jsonschema.validate(json.loads(together[10 + j]), PERSON)


@pytest.mark.parametrize("grammar", ["start: nope(", json_schema_grammar({"type": "nonsense"})])
async def test_a_grammar_that_does_not_compile_is_refused_at_submission(model_cache_dir, grammar):
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        with pytest.raises(GrammarError, match="does not compile"):
            await engine.submit("hi", params=SamplingParams(grammar=grammar))
        text, _ = await text_of(engine, SamplingParams(max_tokens=3, temperature=0))
    assert text  # and the engine serves on


@pytest.mark.parametrize("name", list(UNFOLLOWABLE))
async def test_a_schema_the_grammar_cannot_follow_is_refused_at_submission(model_cache_dir, name):
    schema, why = UNFOLLOWABLE[name]
    params = SamplingParams(max_tokens=20, temperature=0, grammar=json_schema_grammar(schema))
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        with pytest.raises(GrammarError, match="cannot be followed") as refused:
            await engine.submit("hi", params=params)
        text, last = await text_of(engine, SamplingParams(max_tokens=3, temperature=0))
    assert why in str(refused.value)
    assert text and last.finish_reason == "length"  # and the engine serves on


async def test_a_grammar_that_fails_mid_generation_ends_its_request_with_an_error(model_cache_dir):
    params = SamplingParams(max_tokens=40, temperature=0, grammar=json_schema_grammar(FAILS_LATER))
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        # The second one runs as the first did: the first's failure left the compiled grammar
        # it shared (its lexer) spent, so it was compiled afresh.
        runs = [await text_of(engine, params) for _ in range(2)]
        again, _ = await text_of(engine, SamplingParams(max_tokens=3, temperature=0))
    for text, last in runs:
        assert last.finish_reason == "error"  # never "stop" over a cut document
        assert last.error.startswith(GRAMMAR_FAILED) and "lexer" in last.error
        assert text.startswith('{"n":') and '"x"' not in text  # what came before the failure
    assert again


async def test_a_recursion_past_the_step_item_limit_is_refused_by_our_limit(demo):
    # llguidance's own default (50,000 items a step) would let a mask run 2.5x as long.
    schema = UNFOLLOWABLE["a recursion that never closes"][0]
    compiler = grammar_module.GrammarCompiler(demo.tokenizer, demo.model.args.vocab_size)
    with pytest.raises(GrammarError, match=f"limit {grammar_module.LIMITS.step_max_items}"):
        compiler.compile(json_schema_grammar(schema))


async def test_a_grammar_slower_to_compile_than_the_time_limit_is_refused(
    model_cache_dir, monkeypatch
):
    big = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(1000)
        ]
    }  # tens of milliseconds to compile, at least
    params = SamplingParams(max_tokens=3, grammar=json_schema_grammar(big))
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        monkeypatch.setattr(grammar_module, "COMPILE_TIMEOUT_S", 0.001)
        with pytest.raises(GrammarError, match="too complex: compiling its grammar took more"):
            await engine.submit("hi", params=params)


async def test_a_request_whose_grammar_is_compiled_waits_for_no_other_compile(model_cache_dir):
    grammar = json_schema_grammar({"enum": ["yes", "no"]})
    params = SamplingParams(max_tokens=12, temperature=0, grammar=grammar)
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        engine._compiles.slots.total_tokens = 1
        await text_of(engine, params)  # compiled once
        busy, done = anyio.Event(), anyio.Event()

        async def compiling() -> None:  # every compile slot busy (a complex schema, say)
            async with engine._compiles.slots:
                busy.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(compiling)
            await busy.wait()
            with anyio.fail_after(10):
                text, last = await text_of(engine, params)
            done.set()
    assert json.loads(text) in ("yes", "no") and last.finish_reason == "stop"


async def test_no_grammar_compiles_on_the_executor_though_the_cache_lets_them_go(
    model_cache_dir, monkeypatch
):
    threads: list[str] = []
    check_start = grammar_module._check_start

    def recording(matcher, vocab_size):
        threads.append(threading.current_thread().name)
        check_start(matcher, vocab_size)

    monkeypatch.setattr(grammar_module, "_check_start", recording)
    schemas = [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "boolean"}},
            "required": [f"k{i}"],
            "additionalProperties": False,
        }
        for i in range(6)
    ]
    # A cache that keeps only the newest grammar: each request's is let go before it starts.
    async with Engine.open(
        "stepline-demo", max_step_tokens=16, max_num_seqs=2, grammar_cache_mb=0
    ) as engine:
        results: dict[int, tuple[str, object]] = {}

        async def run(i: int) -> None:
            grammar = json_schema_grammar(schemas[i])
            params = SamplingParams(max_tokens=30, temperature=0, grammar=grammar)
            results[i] = await text_of(engine, params, prompt=f"json {i} " * 20)

        async with anyio.create_task_group() as tg:
            for i in range(len(schemas)):
                tg.start_soon(run, i)
    # (A compile another test abandoned past its time limit may still finish meanwhile.)
    assert len(threads) >= len(schemas) and "stepline-executor" not in threads
    for i, (text, last) in results.items():
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(text), schemas[i])


async def test_cancelling_a_constrained_request_mid_decode_leaves_the_engine_serving(
    model_cache_dir,
):
    forced = SamplingParams(max_tokens=60, temperature=0, grammar=json_schema_grammar(PERSON))
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        stream = await engine.submit(messages=[{"role": "user", "content": "hi"}], params=forced)
        async for out in stream:
            if out.num_output_tokens >= 3:
                break
        await stream.aclose()
        # the same prompt again: a prefix-cache hit, and its grammar starts from the beginning
        text, last = await text_of(engine, forced)
        assert engine.step_loop.states.keys() == set()
    jsonschema.validate(json.loads(text), PERSON)
    assert last.finish_reason == "stop" and last.num_cached_tokens > 0


async def test_a_constrained_run_reexecutes_to_the_same_tokens_from_its_log(
    tmp_path, model_cache_dir
):
    from stepline.api.reexecute import reexecute

    log = tmp_path / "run.jsonl"
    forced = SamplingParams(
        max_tokens=150, temperature=0.9, seed=5, grammar=json_schema_grammar(PERSON)
    )
    async with Engine.open("stepline-demo", max_step_tokens=64, event_log=log) as engine:
        text, _ = await text_of(engine, forced)
    jsonschema.validate(json.loads(text), PERSON)

    report = await reexecute(log)

    assert (report.num_same, report.num_diverged, report.num_skipped) == (1, 0, 0)


@pytest.mark.parametrize("opened", [False, True])
def test_a_think_budget_leaves_only_the_closing_tag_once_spent(demo, opened):
    from stepline.engine.grammar import CallFormat, GrammarCompiler, ThinkFormat, answer_grammar

    tok = demo.tokenizer
    open_tag, close_tag, call_start, call_end = (
        markup(tok, t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")
    )
    calls = CallFormat((("f", {"type": "object"}),), call_start, call_end)
    grammar = answer_grammar(calls, think=ThinkFormat(open_tag, close_tag, 4, opened=opened))
    matcher = GrammarCompiler(tok, demo.model.args.vocab_size).matcher(grammar)
    think_id, end_id = (tok.encode(t, add_special_tokens=False)[0] for t in ("<think>", "</think>"))
    thought = tok.encode("one two three four five six", add_special_tokens=False)
    assert (opened or matcher.consume_token(think_id)) and len(thought) > 4

    assert all(matcher.consume_token(t) for t in thought[:4])
    assert not matcher.deep_copy().consume_token(thought[4])  # the budget is spent
    assert matcher.consume_token(end_id)
    assert matcher.consume_token(thought[0])  # then the answer is free
