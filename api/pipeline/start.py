"""A request's start, for every door: `Starter.start` turns a door's `Call` into an engine
request, up to its admission: images fetched, the prompt's tokens (off the event loop), its
token limit, the think budget, its sampling parameters (the one builder, `sampling`), and the
submission to the engine of the model serving it (`RequestContext`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from starlette.datastructures import Headers

from stepline.api.config import ServerConfig
from stepline.api.params import SamplingParams
from stepline.api.pipeline.agents import AgentPlan
from stepline.api.pipeline.audio import resolve_audio
from stepline.api.pipeline.embed import embedding_only
from stepline.api.pipeline.errors import APIError, context_exceeded, known_error
from stepline.api.pipeline.images import ImagesBusyError, resolve_images
from stepline.api.pipeline.model_output import OutputFormat, OutputSplitter
from stepline.api.pipeline.next_turn import NextTurn
from stepline.api.pipeline.resume import presented_key
from stepline.api.pipeline.served import RequestContext
from stepline.api.prompts import Prepared
from stepline.engine.media import MediaError
from stepline.engine.sampling_limits import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from stepline.api.engine import Engine, RequestStream

log = structlog.get_logger(__name__)

# The sampling fields a door's request may carry, by their engine names (`Starter.sampling`).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repeat_last_n",
)
EFFECTIVE_MAX_TOKENS_HEADER = "x-stepline-max-tokens"  # set when a max_tokens was clamped
# The tools a request's `tools` lost: hosted ones (Responses), or all of them when the model's
# chat template cannot show or read tool calls.
DROPPED_TOOLS_HEADER = "x-stepline-dropped-tools"


@dataclass
class Call:
    """One door's request in engine terms: what every API asks of the engine."""

    rid: str
    sampling: Any  # the request: its sampling fields by their engine names (`Starter.sampling`)
    agent: AgentPlan  # tools, output constraints, template arguments
    prompt_param: str  # the request field that holds the prompt (for errors)
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None  # as requested
    max_tokens_param: str = "max_tokens"
    default_max_tokens: int | None = None  # a door's own default (None: the model's)
    whole_context: bool = False  # no max_tokens: the room left in the context, asked for
    context_window: int | None = None  # the request's own context (Ollama's num_ctx)
    context_window_param: str = "num_ctx"
    # A door's documented defaults (Ollama's `DefaultOptions`), under the model's own.
    door_defaults: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None
    reasoning: bool = False  # split think blocks into reasoning
    think_budget: int | None = None  # most tokens the think block may take
    headers: dict[str, str] = field(default_factory=dict)  # for the response
    client: str | None = None  # who sends it (`client_of`); None: the anonymous client
    # its door's client sends a tool call back as its parsed input (Anthropic's
    # `tool_use.input`, {} for arguments that are not JSON), not as its text (next_turn.py)
    calls_as_input: bool = False


def client_of(headers: Headers, user: str | None = None) -> str | None:
    """Who sends a request, for fair share between clients (`Engine.submit`'s `client`): the
    API key it carries and, within a key, the end user its body names (`user`, ...). A
    server has one `--api-key`, which every client then carries: `user` is what tells them
    apart. Each as a fingerprint, since the event log records the client (a key, or a
    user's e-mail, must not reach it); None for a request with neither (every such request
    is one anonymous client)."""
    key = presented_key(headers)
    parts = [f"key:{_fingerprint(key)}"] if key else []
    if user:
        parts.append(f"user:{_fingerprint(user)}")
    return " ".join(parts) or None


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass
class Started:
    """An admitted request, and how to read its output."""

    ctx: RequestContext[Any]  # the request, and the model serving it
    rid: str
    stream: RequestStream
    fmt: OutputFormat
    tools: list[dict[str, Any]] | None  # the tool definitions (some parsers read them)
    max_tokens: int  # the effective limit
    headers: dict[str, str]  # the response's: the request id, a clamped max_tokens, ...
    # called with the answer's whole text once it ended (stop or length): its next turn's
    # prefill (next_turn.py); None: nothing to do
    after: Callable[[str], None] | None = None

    def splitter(self) -> OutputSplitter:
        """A streaming splitter of this request's output (non-streamed answers split the whole
        text at once, `split_output`)."""
        return OutputSplitter(self.fmt, self.tools, stream=True)


class Starter:
    """Requests started, for every door of one app, under the server's options."""

    def __init__(self, config: ServerConfig):
        self.config = config

    async def start(self, ctx: RequestContext[Any], call: Call) -> Started:
        """`call` into an engine request, up to its admission: the prompt's tokens (off the
        event loop), its token limit, the think budget, its sampling parameters, and the
        submission. Raises APIError for what cannot be served."""
        try:
            return await self._start(ctx, call)
        except Exception as exc:  # what the engine refuses, by the catalogue; else a bug
            err = known_error(
                exc, prompt_param=call.prompt_param, grammar_param=call.agent.grammar_param
            )
            if err is None:
                raise
            raise err from None

    async def _start(self, ctx: RequestContext[Any], call: Call) -> Started:
        if ctx.engine.embedding is not None:
            raise embedding_only(ctx.model.name)
        agent = call.agent
        messages = None if call.messages is None else await self.with_images(ctx, call.messages)
        prepared = await self.prepare(
            ctx,
            prompt=call.prompt,
            messages=messages,
            template_kwargs=agent.template_kwargs,
            param=call.prompt_param,
        )
        ids = prepared.ids
        engine = ctx.engine
        defaults = ctx.model.defaults
        if call.context_window is not None:
            self.check_window(engine, call, len(ids))
        max_tokens = self.max_tokens(
            engine,
            call.max_tokens,
            len(ids),
            default=None if call.whole_context else call.default_max_tokens or defaults.max_tokens,
            prompt_param=call.prompt_param,
            param=call.max_tokens_param,
        )
        if call.context_window is not None:
            max_tokens = min(max_tokens, call.context_window - len(ids))
        tokenizer = engine.tokenizer
        prompt_text = tokenizer.decode(ids[-8:])
        if call.think_budget is not None:
            agent = agent.with_think_budget(tokenizer, call.think_budget, prompt_text)
        below = {**call.door_defaults, **defaults.sampling.values()}
        params = self.sampling(
            call.sampling,
            max_tokens,
            call.logprobs,
            agent.grammar,
            below,
            loop_guard=self.loop_guarded(call),
        )
        stream = await engine.submit(
            prepared,
            params=params,
            request_id=call.rid,
            client=call.client,
            adapter=ctx.adapter,
            door=ctx.request.url.path,
        )
        if stream.params is not None:  # as admitted: the limit the request runs to
            max_tokens = stream.params.max_tokens
        fmt = agent.output_format(tokenizer, reasoning=call.reasoning, prompt_text=prompt_text)
        headers = {"x-request-id": call.rid, **call.headers}
        if agent.dropped_tools:
            # Tools the model cannot use: hosted ones (Responses), or any offered, not forced,
            # to a model that cannot show or read tool calls; it answers in text.
            log.info("tools_dropped", request_id=call.rid, tools=agent.dropped_tools)
            headers[DROPPED_TOOLS_HEADER] = ", ".join(agent.dropped_tools)
        if call.max_tokens is not None and max_tokens < call.max_tokens:
            headers[EFFECTIVE_MAX_TOKENS_HEADER] = str(max_tokens)
        started = Started(
            ctx, call.rid, stream, fmt, agent.openai_tools or None, max_tokens, headers
        )
        if messages is not None and self.next_turn_wanted(engine, messages):
            started.after = NextTurn(
                engine,
                call.rid,
                messages,
                agent.template_kwargs,
                fmt,
                started.tools,
                call.client,
                ids,
                calls_as_input=call.calls_as_input,
            ).after
        return started

    def loop_guarded(self, call: Call) -> bool:
        """Whether the answer ends once it repeats itself verbatim (reason loop:
        actors/scheduler/loop_guard.py): under `--loop-guard auto`, every request but one
        that asks for exactly its length (`ignore_eos`). A cap of the request's own is no
        ask for a loop: Open WebUI's title job sends 1,000 tokens and Anthropic's API always
        carries `max_tokens` (Claude Code's 32,000), and a small model loops to them."""
        mode = self.config.loop_guard
        if mode == "auto":
            return not getattr(call.sampling, "ignore_eos", False)
        return mode == "on"

    def next_turn_wanted(self, engine: Engine, messages: list[dict[str, Any]]) -> bool:
        """Whether a chat's next turn is prefilled once it ends (`next_turn.py`): where the
        server says so and the model has a prefix cache; not for images (their turn would be
        rendered and read again)."""
        return (
            self.config.next_turn_prefill
            and engine.step_loop.index is not None
            and not any(isinstance(m.get("content"), list) for m in messages)
        )

    def check_window(self, engine: Engine, call: Call, num_prompt: int) -> None:
        """Raises APIError (400) for a request's own context (`call.context_window`) past
        the model's here, or one its prompt does not fit."""
        window, max_context = call.context_window, engine.max_context
        assert window is not None
        if window > max_context:
            raise APIError(
                400,
                f"{call.context_window_param} is {window}, but this server holds at most "
                f"{max_context} tokens of context for this model: set it to at most "
                f"{max_context}, or leave it out",
                param=call.context_window_param,
                code="context_length_exceeded",
            )
        if num_prompt >= window:
            raise context_exceeded(num_prompt, window, call.prompt_param, at_least=False)

    def max_tokens(
        self,
        engine: Engine,
        requested: int | None,
        num_prompt: int,
        *,
        default: int | None,
        prompt_param: str,
        param: str = "max_tokens",
    ) -> int:
        """The request's token limit (`Engine.max_output_tokens`, the engine's one): `requested`,
        or by default `default` (None: the room left in the context), within the KV budget. A
        `requested` past the room is clamped to it (agents such as Claude Code cannot be told
        a local model's context), unless `strict_max_tokens`, where past the context it is a
        400."""
        max_context = engine.max_context
        if num_prompt >= max_context:
            raise context_exceeded(num_prompt, max_context, prompt_param, at_least=False)
        if requested is not None and self.config.strict_max_tokens:
            context_room = engine.max_output_tokens(None, num_prompt, within_kv_budget=False)
            if requested > context_room:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_context} tokens, but "
                    f"{num_prompt + requested} tokens were requested ({num_prompt} in the "
                    f"prompt, {requested} in the completion): shorten the prompt or lower "
                    f"{param} to at most {context_room}",
                    param=param,
                    code="context_length_exceeded",
                )
            return requested  # past the KV budget: the submission says by how much
        asked = requested if requested is not None else (default or None)
        limit = engine.max_output_tokens(asked, num_prompt)
        if requested is not None and limit < requested:
            log.info("max_tokens_clamped", requested=requested, effective=limit, param=param)
        return limit

    def sampling(
        self,
        req: Any,
        max_tokens: int,
        logprobs: int | None,
        grammar: str | None = None,
        defaults: dict[str, Any] | None = None,
        *,
        loop_guard: bool = False,
    ) -> SamplingParams:
        """The one parameter builder of every door: `req`'s sampling fields (those of
        `SAMPLING_FIELDS` it has, already range-checked; `stop_strings`, `ignore_eos`,
        `top_k`, `stop_token_ids`) as engine parameters, over `defaults` (the model's and the
        door's, by engine names: api/defaults.py), over the engine's; the checks that need the model
        (`top_k` and `stop_token_ids` within the vocabulary) are `Engine.submit`'s. A
        temperature below GREEDY_TEMPERATURE is greedy; `loop_guard`: the answer ends once it
        loops (`loop_guarded`)."""
        top_k = getattr(req, "top_k", None)
        stop_token_ids = getattr(req, "stop_token_ids", None)
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": tuple(getattr(req, "stop_strings", ())),
            "ignore_eos": getattr(req, "ignore_eos", False),
            "logprobs": logprobs,
            "grammar": grammar,
            "loop_guard": loop_guard,
            **(defaults or {}),
        }
        for name in SAMPLING_FIELDS:
            value = getattr(req, name, None)
            if value is not None:
                fields[name] = value
        temperature = fields.get("temperature")
        if temperature is not None and temperature < GREEDY_TEMPERATURE:
            fields["temperature"] = 0.0
        if top_k is not None:
            fields["top_k"] = max(top_k, 0)
        if stop_token_ids:
            fields["stop_token_ids"] = tuple(stop_token_ids)
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise known_error(exc) or exc from None

    async def prepare(
        self,
        ctx: RequestContext[Any],
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        param: str = "messages",  # the request field errors name
    ) -> Prepared:
        """Token ids, chat checkpoints and images, computed off the event loop. Raises APIError
        for a prompt past the context, messages the chat template refuses, or an image the
        model cannot read."""
        try:
            return await ctx.engine.prepare_async(prompt, messages, template_kwargs)
        except ValueError as exc:
            raise known_error(exc, prompt_param=param) or exc from None

    async def with_images(
        self, ctx: RequestContext[Any], messages: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """`messages` with their image parts fetched and decoded (`resolve_images`), and their
        audio parts decoded (`resolve_audio`). Raises APIError (400) for images or audio this
        server does not take: any, to a model without the encoder; 429 when the server's
        pixel budget stays full."""
        try:
            messages = await resolve_images(messages, ctx.model.images)
            return await resolve_audio(messages, ctx.model.audio)
        except (MediaError, ImagesBusyError) as exc:
            raise known_error(exc) or exc from None
