"""The Ollama door's handlers, over the pipeline every door shares: `POST /api/chat` and
`/api/generate` (streamed as JSON lines unless `"stream": false`), `GET /api/tags`,
`/api/ps`, `/api/version`, `POST /api/show`; `POST /api/pull` and `DELETE /api/delete`
answer that models are configured when the server starts.

A request's options left out are the model's defaults (its generation_config.json and its
models-file table: what a Modelfile's parameters are to Ollama), else Ollama's own
`DefaultOptions` (`OLLAMA_DEFAULTS`), as Ollama layers them.

Every request gets an id (`ollama-<hex>`), its id in the event log and its `x-request-id`.
The last line of an answer (`"done": true`) carries its `done_reason` (`stop`, `length`) and
Ollama's counts and durations (nanoseconds): the prompt's tokens and the time to the first
token (`prompt_eval_*`), the answer's tokens and the time after it (`eval_*`).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic_core import to_json

from stepline.api.ollama.facts import ModelFacts
from stepline.api.ollama.schema import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ModelRequest,
    OllamaRequest,
    ShowRequest,
)
from stepline.api.ollama.wire import OLLAMA
from stepline.api.pipeline import embed
from stepline.api.pipeline.agents import (
    AgentPlan,
    openai_tools,
    plan,
    reads_template_kwarg,
    tools_unusable,
)
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.model_output import OutputDelta, ToolCall, split_output
from stepline.api.pipeline.served import ServedModel
from stepline.api.pipeline.serving import (
    Call,
    Piece,
    RequestContext,
    Serving,
    Started,
    client_of,
)

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput

API_VERSION = "0.12.0"  # the Ollama API these routes follow, for clients that check it
NEVER = "2999-12-31T23:59:59Z"  # /api/ps's expires_at of a model never unloaded
# Ollama's `DefaultOptions` (api/types.go) by engine names, under the model's own defaults.
# repeat_penalty is 1.0 as in Ollama from v0.32.10 on (1.1 before); the penalties (a model's
# own repetition_penalty included) look at the last 64 tokens, as Ollama's repeat_last_n.
# num_predict -1 (no limit) is not taken: a request that sets none gets the model's cap, one
# that sends -1 or -2 the room left in the context.
OLLAMA_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "repetition_penalty": 1.0,
    "repeat_last_n": 64,
}
# Engine names -> Ollama's option names, for /api/show's `parameters`.
OPTION_NAMES = {"repetition_penalty": "repeat_penalty"}
CONFIGURED = (
    "models are configured when stepline starts (--model, or --models FILE); it does not "
    "download or delete them"
)


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _now() -> str:
    return _iso(datetime.now(UTC))


class OllamaDoor:
    def __init__(self, serving: Serving):
        self.serving = serving

    # -- models --

    def facts(self, served: ServedModel) -> ModelFacts:
        """What the listings say of a loaded model, read from its files once."""
        facts = served.door_facts.get("ollama")
        if facts is None:
            facts = served.door_facts["ollama"] = ModelFacts.read(Path(served.engine.loaded.path))
        return facts

    def details(self, f: ModelFacts | None) -> dict[str, Any]:
        if f is None:  # a model not loaded yet: its files are read once it is
            return {"parent_model": "", "format": "safetensors", "family": "", "families": None}
        return {
            "parent_model": "",
            "format": f.format,
            "family": f.family,
            "families": [f.family] if f.family else None,
            "parameter_size": f.parameter_size,
            "quantization_level": f.quantization_level,
        }

    def card(self, name: str, f: ModelFacts | None) -> dict[str, Any]:
        tagged = name if ":" in name else f"{name}:latest"  # as Ollama lists every model
        return {
            "name": tagged,
            "model": tagged,
            "modified_at": f.modified_at if f is not None else _now(),
            "size": f.size if f is not None else 0,
            "digest": f.digest if f is not None else "",
            "details": self.details(f),
        }

    def tags(self) -> dict[str, Any]:
        """Every served model, loaded or not."""
        cards = []
        for name in self.serving.models.listed:
            served = self.serving.loaded(name)
            card = self.card(name, self.facts(served) if served is not None else None)
            if served is not None:  # what it does (stepline's; /api/show's names)
                card["capabilities"] = self.capabilities(served)
            cards.append(card)
        return {"models": cards}

    def capabilities(self, served: ServedModel) -> list[str]:
        """What a loaded model does, in /api/show's words."""
        engine = served.engine
        if engine.embedding is not None:  # (a reranker has no Ollama name: none of these)
            return ["embedding"] if embed.is_embedder(engine) else []
        tokenizer = engine.tokenizer
        capabilities = ["completion"]
        if tools_unusable(tokenizer, parse=True) is None:
            capabilities.append("tools")
        if getattr(tokenizer, "think_start", None):
            capabilities.append("thinking")
        if engine.accepts_images:  # what Ollama's clients look for to send images
            capabilities.append("vision")
        return capabilities

    def ps(self) -> dict[str, Any]:
        """The loaded models."""
        models = []
        for name in self.serving.models.listed:
            served = self.serving.loaded(name)
            if served is None:
                continue
            card = self.card(name, self.facts(served))
            del card["modified_at"]
            context = served.engine.max_context
            entry = self.serving.models.entry_of(name)
            at = entry.expires_at() if entry is not None else None
            expires = NEVER if at is None else _iso(datetime.fromtimestamp(at, UTC))
            models.append({**card, "expires_at": expires, "context_length": context})
        return {"models": models}

    async def show(self, ctx: RequestContext[ShowRequest]) -> Response:
        engine = ctx.engine
        tokenizer = engine.tokenizer
        f = self.facts(ctx.model)
        capabilities = self.capabilities(ctx.model)
        template = getattr(tokenizer, "chat_template", None)
        parameters = self.parameters(ctx.model)
        modelfile = f"# served by stepline from {engine.loaded.path}\n" + "".join(
            f"PARAMETER {line}\n" for line in parameters.splitlines()
        )
        return JSONResponse(
            {
                "modelfile": modelfile,
                "parameters": parameters,
                "template": template if isinstance(template, str) else "",
                "details": self.details(f),
                "model_info": {
                    "general.architecture": f.family,
                    "general.parameter_count": f.num_params,
                    f"{f.family}.context_length": engine.max_context,
                    # the precision the weights are served in (float32 on the CPU backend,
                    # whatever the file holds), and why: stepline's own key
                    "stepline.weights": getattr(engine.loaded, "weights", ""),
                },
                "capabilities": capabilities,
                "modified_at": f.modified_at,
            }
        )

    # -- /api/embed, /api/embeddings --

    async def embed(self, ctx: RequestContext[EmbedRequest]) -> Response:
        req, t0 = ctx.body, time.perf_counter_ns()
        done = await embed.embed(
            self.serving,
            ctx,
            req.inputs(),
            dimensions=req.dimensions,
            truncate=req.truncate,
            client=client_of(ctx.request.headers),
        )
        return JSONResponse(
            {
                "model": req.model,
                "embeddings": done.vectors,
                "total_duration": time.perf_counter_ns() - t0,
                "load_duration": 0,
                "prompt_eval_count": done.num_prompt_tokens,
            },
            headers={"x-request-id": ctx.rid},
        )

    async def embeddings(self, ctx: RequestContext[EmbeddingsRequest]) -> Response:
        req = ctx.body
        done = await embed.embed(
            self.serving,
            ctx,
            [req.prompt],
            param="prompt",
            truncate=True,
            client=client_of(ctx.request.headers),
        )
        return JSONResponse({"embedding": done.vectors[0]}, headers={"x-request-id": ctx.rid})

    def parameters(self, served: ServedModel) -> str:
        """The options a request that sets none gets, as Modelfile parameters (`name value`
        lines, as /api/show's `parameters`): the model's over Ollama's, and its cap."""
        values = {**OLLAMA_DEFAULTS, **served.defaults.sampling.values()}
        values["num_predict"] = served.defaults.max_tokens
        return "\n".join(
            f"{OPTION_NAMES.get(k, k):<30} {v:g}" if isinstance(v, float) else f"{k:<30} {v}"
            for k, v in values.items()
        )

    # -- pull and delete: models are the command line's --

    async def configured(
        self, request: Request, answer: Callable[[ModelRequest], Response]
    ) -> Response:
        """`answer` to a /api/pull or /api/delete body; nothing is loaded, fetched or
        removed. Errors in Ollama's shape."""
        intake = self.serving.intake
        try:
            raw = await intake.read_body(request, any_media_type=True)
            return answer(await intake.parse(raw, ModelRequest))
        except APIError as err:
            return OLLAMA.response(err)

    def pull(self, req: ModelRequest) -> Response:
        """A served model needs no pull: Ollama's last progress line, `success` (a client
        that pulls before it chats goes on). Any other is a 404 saying where models come
        from."""
        if req.model not in self.serving.served_model_names:
            raise APIError(
                404,
                f"{req.model!r} is not served here, and cannot be pulled: {CONFIGURED}; "
                f"served: {', '.join(self.serving.models.listed)}",
                param="model",
            )
        status = {"status": "success"}
        if req.stream:
            return Response(to_json(status) + b"\n", media_type="application/x-ndjson")
        return JSONResponse(status)

    def delete(self, req: ModelRequest) -> Response:
        raise APIError(400, f"{req.model!r} cannot be deleted here: {CONFIGURED}", param="model")

    # -- chat and generate --

    def _plan(self, ctx: RequestContext[Any], tools: Any = None) -> AgentPlan:
        req: OllamaRequest = ctx.body
        tokenizer = ctx.engine.tokenizer
        kwargs = dict(ctx.model.default_template_kwargs)
        think = req.thinking()
        if think and not getattr(tokenizer, "think_start", None):
            raise APIError(
                400,
                f"{ctx.model.name!r} does not support thinking: drop `think`",
                param="think",
                code="unsupported_parameter",
            )
        if think is not None and reads_template_kwarg(tokenizer, "enable_thinking"):
            kwargs["enable_thinking"] = think
        schema, json_object = req.answer_format()
        return plan(
            tokenizer,
            tools=openai_tools(tools),
            schema=schema,
            json_object=json_object,
            template_kwargs=kwargs,
            schema_param="format",
        )

    def _keep(self, ctx: RequestContext[Any]) -> str:
        """The request's keep_alive applied to its model (`ModelEntry.keep_loaded`); the
        `done_reason` of a request with nothing to answer: Ollama's way to load a model
        ("load"), or with keep_alive 0 to unload it ("unload", once it is idle)."""
        seconds = ctx.body.kept_for()
        if seconds is not None:
            ctx.entry.keep_loaded(None if seconds == math.inf else seconds)
        return "unload" if seconds == 0 else "load"

    async def chat(self, ctx: RequestContext[ChatRequest]) -> Response:
        req = ctx.body
        reason = self._keep(ctx)
        if not req.messages:  # Ollama's way to load (or unload) a model
            body = self._head(ctx, {"message": {"role": "assistant", "content": ""}})
            return JSONResponse({**body, "done": True, "done_reason": reason})
        call = Call(ctx.rid, req, self._plan(ctx, req.tools), "messages", req.engine_messages())
        return await self._answer(ctx, call, chat=True)

    async def generate(self, ctx: RequestContext[GenerateRequest]) -> Response:
        req = ctx.body
        reason = self._keep(ctx)
        if not req.prompt and not req.system:  # Ollama's way to load (or unload) a model
            body = self._head(ctx, {"response": ""})
            return JSONResponse({**body, "done": True, "done_reason": reason})
        prompt, messages = req.engine_input()
        call = Call(ctx.rid, req, self._plan(ctx), "prompt", messages, prompt)
        return await self._answer(ctx, call, chat=False)

    async def _answer(self, ctx: RequestContext[Any], call: Call, *, chat: bool) -> Response:
        """`call` (with the request's token limit and thinking) streamed, or whole."""
        serving, req = self.serving, ctx.body
        call.max_tokens = req.max_tokens
        call.max_tokens_param = "options.num_predict"
        call.whole_context = req.whole_context
        call.context_window, call.context_window_param = req.opts.num_ctx, "options.num_ctx"
        call.door_defaults = OLLAMA_DEFAULTS
        call.reasoning = ctx.model.reasoning or bool(req.thinking())
        call.client = client_of(ctx.request.headers)  # Ollama's requests name no user
        started = await serving.start(ctx, call)
        renderer = OllamaRenderer(self, req, started, chat=chat)
        if req.stream:
            return serving.stream(started, renderer, OLLAMA)
        outs = await serving.collect(ctx.request, started)
        split = split_output("".join(o.text for o in outs), started.fmt, started.tools)
        body = {**renderer.body(split), **renderer.done(outs[-1])}
        return Response(to_json(body), media_type="application/json", headers=started.headers)

    def _head(self, ctx: RequestContext[Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": ctx.response_model,
            "created_at": _now(),
            **fields,
        }


def _call(call: ToolCall) -> dict[str, Any]:
    # Ollama's calls carry their arguments as an object (a cut-off call's: empty).
    return {"function": {"name": call.name, "arguments": call.input}}


class OllamaRenderer:
    """One answer as Ollama's JSON lines: a line per piece of text, thinking or completed
    tool calls (`"done": false`), then the last line with the counts and durations."""

    def __init__(self, door: OllamaDoor, req: OllamaRequest, started: Started, *, chat: bool):
        self.door, self.req, self.chat = door, req, chat
        self.ctx = started.ctx
        self.splitter = started.splitter()
        self.t0 = started.ctx.arrived_at  # when the request came (time.time())

    def body(self, delta: OutputDelta) -> dict[str, Any]:
        """A line's answer part: the chat message, or generate's `response`."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": delta.content}
            if delta.reasoning:
                message["thinking"] = delta.reasoning
            if delta.tool_calls:
                message["tool_calls"] = [_call(c) for c in delta.tool_calls]
            return self.door._head(self.ctx, {"message": message})
        fields: dict[str, Any] = {"response": delta.content}
        if delta.reasoning:
            fields["thinking"] = delta.reasoning
        return self.door._head(self.ctx, fields)

    def done(self, out: RequestOutput) -> dict[str, Any]:
        """The last line's own fields; when the first token came is the engine's record."""
        end = time.time()
        state = self.ctx.engine.step_loop.state_of(out.request_id)
        first = state.first_token_ts if state is not None and state.first_token_ts else end
        return {
            "done": True,
            "done_reason": out.finish_reason,
            "total_duration": int((end - self.t0) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": out.num_prompt_tokens,
            "prompt_eval_duration": int((first - self.t0) * 1e9),
            "eval_count": out.num_output_tokens,
            "eval_duration": int((end - first) * 1e9),
        }

    def frames(self, piece: Piece) -> bytes:
        if piece.is_progress:
            return b""
        out = piece.out
        lines = []
        if piece.delta:
            lines.append(to_json({**self.body(piece.delta), "done": False}) + b"\n")
        if out.finish_reason is not None:
            last = {**self.body(OutputDelta()), **self.done(out)}
            lines.append(to_json(last) + b"\n")
        return b"".join(lines)

    def failed(self, err: APIError) -> bytes:
        return OLLAMA.frames(err)

    cancelled = failed


def router(serving: Serving) -> APIRouter:
    """Ollama's routes (the app's key check covers them)."""
    door = OllamaDoor(serving)
    routes = APIRouter()

    @routes.post("/api/chat")
    async def chat(request: Request) -> Response:
        rid = f"ollama-{uuid.uuid4().hex}"
        return await serving.handle(
            request, rid, door.chat, OLLAMA, body=ChatRequest, any_media_type=True
        )

    @routes.post("/api/generate")
    async def generate(request: Request) -> Response:
        rid = f"ollama-{uuid.uuid4().hex}"
        return await serving.handle(
            request, rid, door.generate, OLLAMA, body=GenerateRequest, any_media_type=True
        )

    @routes.post("/api/embed")
    async def embed_(request: Request) -> Response:
        rid = f"ollama-{uuid.uuid4().hex}"
        return await serving.handle(
            request, rid, door.embed, OLLAMA, body=EmbedRequest, any_media_type=True
        )

    @routes.post("/api/embeddings")
    async def embeddings(request: Request) -> Response:
        rid = f"ollama-{uuid.uuid4().hex}"
        return await serving.handle(
            request, rid, door.embeddings, OLLAMA, body=EmbeddingsRequest, any_media_type=True
        )

    @routes.post("/api/show")
    async def show(request: Request) -> Response:
        rid = f"show-{uuid.uuid4().hex}"
        return await serving.handle(
            request,
            rid,
            door.show,
            OLLAMA,
            body=ShowRequest,
            generates=False,
            any_media_type=True,
        )

    @routes.post("/api/pull")
    async def pull(request: Request) -> Response:
        return await door.configured(request, door.pull)

    @routes.delete("/api/delete")
    async def delete(request: Request) -> Response:
        return await door.configured(request, door.delete)

    @routes.get("/api/tags")
    async def tags() -> JSONResponse:
        return JSONResponse(door.tags())

    @routes.get("/api/ps")
    async def ps() -> JSONResponse:
        return JSONResponse(door.ps())

    @routes.get("/api/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": API_VERSION})

    return routes
