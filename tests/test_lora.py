"""LoRA adapters as models: requests for several adapters and the base model share one batch
and one step, and each gets the tokens mlx-lm gives it with its adapter alone."""

from __future__ import annotations

import random
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from helpers import collect, mlx_lm_greedy, submit_together
from lora_files import make_adapter, mlx_lm_with_adapter

from stepline.api import Engine, SamplingParams
from stepline.engine.lora import WEIGHTS_FILE as WEIGHTS
from stepline.engine.lora import AdapterError
from stepline.engine.models import demo_model_path
from stepline.events.log_reader import read_events
from stepline.events.models import Admitted, StepPlanned

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def adapters(demo, tmp_path_factory) -> dict[str, Path]:
    """Three adapters of the demo model: two LoRA of other ranks, one DoRA."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(root / "a", demo.model, seed=1),
        "b": make_adapter(
            root / "b", demo.model, seed=2, rank=8, keys=("self_attn.o_proj", "mlp.up_proj")
        ),
        "c": make_adapter(root / "c", demo.model, seed=3, kind="dora", num_layers=1),
    }


async def test_three_adapters_and_the_base_share_steps_and_each_gets_its_own_tokens(
    demo, adapters, tmp_path
):
    log = tmp_path / "events.jsonl"
    lora = [f"{name}={path}" for name, path in adapters.items()]
    names = [None, "a", "b", "c"]
    requests = [
        {"prompt": prompt_ids(9 + 3 * i, seed=i), "params": GREEDY, "adapter": names[i % 4]}
        for i in range(16)
    ]
    async with Engine.open(
        "stepline-demo", lora=lora, max_num_seqs=16, max_step_tokens=512, event_log=str(log)
    ) as engine:
        assert set(engine.adapters) == {"a", "b", "c"}
        streams = await submit_together(engine, requests)
        outputs = [await collect(s) for s in streams]
    got = [[t for out in outs for t in out.token_ids] for outs in outputs]

    path = demo_model_path()
    references = {n: mlx_lm_with_adapter(path, adapters[n] if n else None) for n in names}
    want = [
        mlx_lm_greedy(references[r["adapter"]], r["prompt"], GREEDY.max_tokens) for r in requests
    ]
    assert got == want
    # the adapters change what the model says
    base = [mlx_lm_greedy(references[None], r["prompt"], GREEDY.max_tokens) for r in requests]
    assert all(g != b for g, b, r in zip(got, base, requests, strict=True) if r["adapter"])

    events = list(read_events(log))
    adapter_of = {
        e.request_id: e.adapter for e in events if isinstance(e, Admitted) and e.origin == "client"
    }
    assert sorted(adapter_of.values(), key=str) == sorted([r["adapter"] for r in requests], key=str)
    shared = [
        e
        for e in events
        if isinstance(e, StepPlanned) and {adapter_of[r] for r in e.request_ids} == set(names)
    ]
    assert shared, "no step ran requests of every adapter and the base model together"


async def test_a_request_for_an_adapter_not_loaded_is_refused_naming_the_served_ones(demo):
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        with pytest.raises(ValueError, match="no LoRA adapter 'nope'.*stepline-demo"):
            await engine.submit([5, 6, 7], params=GREEDY, adapter="nope")


async def test_an_adapter_loaded_while_serving_is_used_by_the_next_request(demo, adapters):
    prompt = prompt_ids(12, seed=7)
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        before = await collect(await engine.submit(prompt, params=GREEDY))
        info = await engine.load_adapter("a", str(adapters["a"]))
        assert (info.kind, info.rank, info.num_modules) == ("lora", 4, 6)
        after = await collect(await engine.submit(prompt, params=GREEDY, adapter="a"))
    want = mlx_lm_greedy(mlx_lm_with_adapter(demo_model_path(), adapters["a"]), prompt, 10)
    assert [t for o in after for t in o.token_ids] == want
    assert [t for o in before for t in o.token_ids] != want


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        ("rank", "its matrices have rank 4, its adapter_config.json says rank 16"),
        ("module", "adapts 'model.layers.0.self_attn.nope', which this model does not have"),
        ("shape", "maps 128 -> 64 features, this model's layer 64 -> 64 .*names 'another/model'"),
        ("full", "is a 'full' fine-tune"),
        ("missing", "has no adapters.safetensors"),
    ],
)
async def test_an_adapter_that_does_not_fit_the_model_is_refused_at_load_with_the_reason(
    demo, tmp_path, spoil, reason
):
    import json

    import mlx.core as mx

    path = make_adapter(tmp_path / "bad", demo.model, seed=5)
    config = json.loads((path / "adapter_config.json").read_text())
    weights = mx.load(str(path / "adapters.safetensors"))
    if spoil == "rank":
        config["lora_parameters"]["rank"] = 16
    elif spoil == "full":
        config["fine_tune_type"] = "full"
    elif spoil == "module":
        weights["model.layers.0.self_attn.nope.lora_a"] = mx.zeros((64, 4))
        weights["model.layers.0.self_attn.nope.lora_b"] = mx.zeros((4, 64))
    elif spoil == "shape":  # trained on a wider model, which its config names
        weights["model.layers.0.self_attn.q_proj.lora_a"] = mx.zeros((128, 4))
        config["model"] = "another/model"
    elif spoil == "missing":
        (path / "adapters.safetensors").unlink()
    (path / "adapter_config.json").write_text(json.dumps(config))
    if spoil != "missing":
        mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    with pytest.raises(AdapterError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        async with Engine.open("stepline-demo", lora=[f"bad={path}"]):
            pass
    async with Engine.open("stepline-demo", max_step_tokens=64) as engine:
        with pytest.raises(AdapterError, match="rank|have|maps|full|has no"):
            await engine.load_adapter("bad", str(path))
        assert engine.adapters == {}


async def test_the_http_doors_route_each_request_by_the_model_it_names(demo, adapters, tmp_path):
    import openai
    from helpers import open_served

    @asynccontextmanager
    async def served_client(served):
        async with served.client() as client:
            yield client

    from stepline.api import SamplingParams as Params

    lora = [f"a={adapters['a']}"]
    prompt = "the adapters say"
    async with (
        open_served(
            "stepline-demo", engine={"lora": lora}, api_key="sk-one", apps={"open": {}}
        ) as served,
        served_client(served) as client,
    ):
        listed = {m.id: m for m in (await client.models.list()).data}
        assert set(listed) == {"stepline-demo", "a"}
        assert listed["a"].model_extra["parent"] == "stepline-demo"

        async def text(model: str) -> str:
            out = await client.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0
            )
            assert out.model == model
            return out.choices[0].text

        via_engine = await collect(
            await served.engine.submit(
                prompt, params=Params(max_tokens=8, temperature=0), adapter="a"
            )
        )
        assert await text("a") == "".join(o.text for o in via_engine)
        assert await text("a") != await text("stepline-demo")

        with pytest.raises(openai.NotFoundError, match="'stepline-demo', 'a'"):
            await text("b")

        async with served.http(headers={"authorization": "Bearer sk-one"}) as http:
            bad = make_adapter(tmp_path / "bad", demo.model, seed=9, rank=4)
            config = (bad / "adapter_config.json").read_text().replace('"rank": 4', '"rank": 2')
            (bad / "adapter_config.json").write_text(config)
            refused = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}
            )
            assert refused.status_code == 400
            assert (
                "rank 4, its adapter_config.json says rank 2" in refused.json()["error"]["message"]
            )
            ok = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}
            )
            assert ok.status_code == 200 and ok.json()["kind"] == "dora"
            tags = (await http.get("/api/tags")).json()
            names = {m["name"] for m in tags["models"]}
            assert names >= {"stepline-demo:latest", "a:latest", "c:latest"}
            chat = {"messages": [{"role": "user", "content": prompt}], "stream": False}
            chat["options"] = {"temperature": 0, "num_predict": 8}
            ollama = {
                m: (await http.post("/api/chat", json={**chat, "model": f"{m}:latest"})).json()
                for m in ("a", "stepline-demo")
            }
            assert ollama["a"]["model"] == "a:latest" or ollama["a"]["model"] == "a"
            assert ollama["a"]["message"] != ollama["stepline-demo"]["message"]
        assert await text("c") != await text("stepline-demo")

        # a server without an API key loads no adapter while serving
        async with served.http(url=served.urls["open"]) as http:
            answer = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(adapters["b"])}
            )
            assert answer.status_code == 403


async def test_a_prefix_cache_hit_never_crosses_adapters(demo, adapters, tmp_path):
    from stepline.events.models import ChunkPrefilled

    log = tmp_path / "events.jsonl"
    prompt = prompt_ids(40, seed=11)
    order = [None, "a", "b", "a", None]
    lora = [f"{n}={adapters[n]}" for n in ("a", "b")]
    async with Engine.open(
        "stepline-demo", lora=lora, max_step_tokens=64, event_log=str(log)
    ) as engine:
        got = []
        for adapter in order:  # one after another: each may find the ones before it cached
            outs = await collect(await engine.submit(prompt, params=GREEDY, adapter=adapter))
            got.append([t for o in outs for t in o.token_ids])
    events = list(read_events(log))
    rids = [e.request_id for e in events if isinstance(e, Admitted) and e.origin == "client"]
    cached = {
        e.request_id: e.num_cached_tokens
        for e in events
        if isinstance(e, ChunkPrefilled) and e.num_cached_tokens
    }
    # the second of each adapter (and of the base) starts from its own first one's cache
    assert [cached.get(r, 0) > 0 for r in rids] == [False, False, False, True, True]
    path = demo_model_path()
    for adapter, tokens in zip(order, got, strict=True):
        model = mlx_lm_with_adapter(path, adapters[adapter] if adapter else None)
        assert tokens == mlx_lm_greedy(model, prompt, GREEDY.max_tokens)


async def test_a_models_file_serves_adapters_of_a_model_in_a_pool_and_counts_their_memory(
    demo, adapters, tmp_path
):
    import httpx
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from stepline.api.config import EventLogConfig, PoolConfig, read_models_file
    from stepline.api.http.app import create_app
    from stepline.api.http.serve import serve_in_process
    from stepline.api.pool import ModelPool
    from stepline.events.models import ModelLoaded

    models_file = tmp_path / "models.toml"
    models_file.write_text(
        f'[models.demo]\nmodel = "stepline-demo"\nlora = {{ a = "{adapters["a"]}" }}\n'
        '[models.other]\nmodel = "stepline-demo"\n'
    )
    config = PoolConfig(models=read_models_file(models_file))
    log = tmp_path / "events.jsonl"
    small = {"max_kv_gb": 0.01, "prefix_cache_gb": 0.01, "max_step_ms": 0, "max_step_tokens": 64}
    async with (
        ModelPool.open(config, small, EventLogConfig(event_log=str(log))) as pool,
        serve_in_process(create_app(pool)) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        assert pool.listed == ("demo", "a", "other")
        body = {"model": "a", "prompt": "hello", "max_tokens": 6, "temperature": 0}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["model"] == "a"
        assert pool.entry_of("a") is pool.entries["demo"]
        base = await http.post("/v1/completions", json={**body, "model": "demo"})
        assert base.json()["choices"][0]["text"] != answer.json()["choices"][0]["text"]
        missing = await http.post("/v1/completions", json={**body, "model": "nope"})
        assert missing.status_code == 404
        assert "'demo', 'a', 'other'" in missing.json()["error"]["message"]
    loaded = next(e for e in read_events(log) if isinstance(e, ModelLoaded) and e.model == "demo")
    base_bytes = sum(a.nbytes for _, a in tree_flatten(demo.model.parameters()))
    adapter_bytes = sum(a.nbytes for a in mx.load(str(adapters["a"] / WEIGHTS)).values())
    assert loaded.weights_bytes == base_bytes + adapter_bytes


async def test_re_execution_loads_each_request_s_adapter_and_gets_the_same_tokens(
    demo, adapters, tmp_path
):
    from stepline.api.reexecute import reexecute
    from stepline.events.models import AdapterLoaded

    log = tmp_path / "events.jsonl"
    lora = [f"a={adapters['a']}"]  # at start (the header's config), and "c" while serving
    async with Engine.open(
        "stepline-demo", lora=lora, max_step_tokens=64, event_log=str(log)
    ) as engine:
        await engine.load_adapter("c", str(adapters["c"]))
        requests = [
            {"prompt": prompt_ids(10 + i, seed=20 + i), "params": GREEDY, "adapter": adapter}
            for i, adapter in enumerate([None, "a", "c"])
        ]
        for stream in await submit_together(engine, requests):
            await collect(stream)
    events = list(read_events(log))
    assert [e.name for e in events if isinstance(e, AdapterLoaded)] == ["c"]
    report = await reexecute(log)
    assert report.ok and report.num_same == 3


async def test_smollm2_requests_for_two_adapters_and_the_base_get_mlx_lm_s_tokens(
    smollm2, tmp_path
):
    keys = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    made = {
        "a": make_adapter(tmp_path / "a", smollm2.model, seed=1, keys=keys, num_layers=4, std=0.2),
        "d": make_adapter(
            tmp_path / "d", smollm2.model, seed=2, kind="dora", keys=keys, num_layers=2, std=0.1
        ),
    }
    texts = [
        "The lighthouse keeper climbed the stairs",
        "A recipe for bread begins with",
        "The capital of France is",
        "Once upon a time, a small robot",
    ]
    requests = [
        {"prompt": smollm2.tokenizer.encode(t), "params": GREEDY, "adapter": adapter}
        for t, adapter in zip(texts, ["a", "d", None, "d"], strict=True)
    ]
    lora = [f"{n}={p}" for n, p in made.items()]
    # (tokens only, max_step_ms=0: no step-time warm-up to wait for)
    options = {"max_num_seqs": 4, "max_step_tokens": 256, "max_step_ms": 0}
    async with Engine.open(smollm2.name, lora=lora, **options) as engine:
        streams = await submit_together(engine, requests)
        got = [[t for o in await collect(s) for t in o.token_ids] for s in streams]
    # (the base's own reference is the session's loaded model: stepline loads it as mlx-lm does)
    models = {None: smollm2.model, **{n: mlx_lm_with_adapter(smollm2.path, made[n]) for n in made}}
    want = [mlx_lm_greedy(models[r["adapter"]], r["prompt"], GREEDY.max_tokens) for r in requests]
    assert got == want
    base = [mlx_lm_greedy(smollm2.model, r["prompt"], GREEDY.max_tokens) for r in requests]
    changed = {r["adapter"] for g, b, r in zip(got, base, requests, strict=True) if g != b}
    assert changed == {"a", "d"}  # each adapter changes what the model says


async def test_drafted_decoding_verifies_each_row_with_its_own_adapter(demo, adapters):
    lora = [f"{n}={adapters[n]}" for n in ("a", "c")]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    path = demo_model_path()
    models = {n: mlx_lm_with_adapter(path, adapters[n] if n else None) for n in (None, "a", "c")}
    requests = []
    for i, adapter in enumerate([None, "a", "c", "a"]):
        # the prompt holds its own adapter's continuation of its start, then the start again:
        # the n-gram drafter proposes that continuation, which only the right adapter accepts
        start = prompt_ids(8, seed=40 + i)
        prompt = start + mlx_lm_greedy(models[adapter], start, 12) + start
        requests.append({"prompt": prompt, "params": GREEDY, "adapter": adapter})
    async with Engine.open(
        "stepline-demo", lora=lora, max_step_tokens=128, speculative_config=spec
    ) as engine:
        runner = engine.step_loop.runner
        run, drafted = runner.run, []

        def counting(work):
            result = run(work)
            drafted.extend(d for d in result.drafted.values() if d)
            return result

        runner.run = counting
        streams = await submit_together(engine, requests)
        got = [[t for o in await collect(s) for t in o.token_ids] for s in streams]
    want = [mlx_lm_greedy(models[r["adapter"]], r["prompt"], GREEDY.max_tokens) for r in requests]
    assert got == want
    assert drafted, "no draft was accepted"


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_an_adapter_over_a_quantized_linear_computes_what_mlx_lm_s_layer_computes(kind):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    from stepline.engine.lora import MultiLoraLinear, Routes, _Delta, _weight

    mx.random.seed(0)
    base = nn.QuantizedLinear.from_linear(nn.Linear(64, 32, bias=False), group_size=32, bits=4)
    ref = (DoRALinear if kind == "dora" else LoRALinear).from_base(base, r=4, scale=2.0)
    ref.lora_b = mx.random.normal(ref.lora_b.shape) * 0.1
    gain = None
    if kind == "dora":
        ref.m = ref.m * mx.random.uniform(0.8, 1.2, ref.m.shape)
        gain = ref.m / mx.linalg.norm(_weight(base) + (2.0 * ref.lora_b.T) @ ref.lora_a.T, axis=1)
    routes = Routes()
    routes.slots["x"] = 0
    layer = MultiLoraLinear(base, routes)
    layer._deltas[0] = _Delta(ref.lora_a, ref.lora_b, 2.0, gain)
    x = mx.random.normal((3, 1, 64))
    with routes.rows(["x", None, "x"]):
        got = layer(x)
    want = ref(x)
    assert mx.allclose(got[0::2], want[0::2], atol=1e-5).item()
    assert mx.array_equal(got[1], base(x)[1]).item()  # the base row is the base's exactly


async def test_a_hybrid_model_s_fused_steps_route_each_row_to_its_adapter(demo_hybrid, tmp_path):
    # recurrent layers run per segment inside the fused step, the adapted experts once over
    # every row: each row must still get its own adapter
    keys = ("mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
    made = {
        n: make_adapter(tmp_path / n, demo_hybrid.model, seed=i, keys=keys, kind=kind)
        for i, (n, kind) in enumerate([("a", "lora"), ("d", "dora")])
    }
    requests = [
        {"prompt": prompt_ids(9 + 2 * i, seed=50 + i), "params": GREEDY, "adapter": adapter}
        for i, adapter in enumerate([None, "a", "d", "a", "d", None])
    ]
    lora = [f"{n}={p}" for n, p in made.items()]
    async with Engine.open(
        "stepline-demo-hybrid", lora=lora, max_num_seqs=6, max_step_tokens=256
    ) as engine:
        assert engine.step_loop.runner.fuse
        streams = await submit_together(engine, requests)
        got = [[t for o in await collect(s) for t in o.token_ids] for s in streams]
    path = demo_model_path("stepline-demo-hybrid")
    models = {n: mlx_lm_with_adapter(path, made[n] if n else None) for n in (None, "a", "d")}
    want = [mlx_lm_greedy(models[r["adapter"]], r["prompt"], GREEDY.max_tokens) for r in requests]
    assert got == want
    base = [mlx_lm_greedy(models[None], r["prompt"], GREEDY.max_tokens) for r in requests]
    changed = {r["adapter"] for g, b, r in zip(got, base, requests, strict=True) if g != b}
    assert changed == {"a", "d"}  # each adapter changes what the model says


def test_adapters_on_a_quantized_model_generate_what_mlx_lm_generates_with_them(adapters):
    # Metal and CUDA keep a quantized model's weights quantized: adapters go over them
    import mlx.nn as nn
    from mlx_lm.tuner.utils import load_adapters

    from stepline.engine.lora import Adapters
    from stepline.engine.models import load_model

    def quantized():
        model = load_model("stepline-demo").model
        nn.quantize(model, group_size=32, bits=4)
        return model

    ours = quantized()
    loras = Adapters(ours)
    for name in ("a", "c"):
        loras.load(name, adapters[name])
    prompt = prompt_ids(12, seed=60)

    class Routed:  # our model, every row of every forward routed to one adapter
        def __init__(self, adapter: str):
            self.adapter = adapter

        def __call__(self, x, cache=None):
            with loras.routes.rows([self.adapter] * x.shape[0]):
                return ours(x, cache=cache)

        def __getattr__(self, attr):
            return getattr(ours, attr)

    for name in ("a", "c"):
        theirs = load_adapters(quantized(), str(adapters[name]))
        assert mlx_lm_greedy(Routed(name), prompt, 10) == mlx_lm_greedy(theirs, prompt, 10)
    assert mlx_lm_greedy(ours, prompt, 10) == mlx_lm_greedy(quantized(), prompt, 10)
