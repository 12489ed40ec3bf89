"""The request actor: one per request, from admission to its terminal event.

It owns what is not the model's: the incremental detokenizer (never splits a UTF-8
character), stop strings (matched on text, never emitted), and the client's output
stream. It wakes once per step (one `Update` from the step loop) and never waits on a
slow client: the client's mailbox takes at most one output per step, and a client that
fell behind takes what piled up as one output (`RequestStream`). The counts it reports
(output tokens, cached prompt tokens) are the scheduler core's, sent with each update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import anyio
import structlog
import tokenizers
from tokenizers.decoders import DecodeStream

from stepline.actors.mailbox import Mailbox
from stepline.actors.messages import Update
from stepline.actors.scheduler.work import TokenLogprob
from stepline.events.models import FinishReason

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """One increment of a request's output."""

    request_id: str
    text: str  # new text since the previous output ("" for progress-only outputs)
    token_ids: tuple[int, ...]  # new token ids since the previous output
    finish_reason: str | None  # "stop", "length", "loop", "cancelled", "error" on the last
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far, in total
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_computed_tokens: int = 0  # prompt tokens prefilled so far (progress of long prompts)
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None  # what went wrong, when finish_reason is "error"
    # an embedding request's vector, on its last output
    embedding: tuple[float, ...] | None = None
    # why its prefix-cache hit stops where it does (`ChunkPrefilled.prefix_miss`; None: it
    # reused all it could, or there is no cache) and how many tokens a cached prefix shared
    prefix_miss: str | None = None
    prefix_shared: int = 0

    @classmethod
    def made(
        cls,
        request_id: str,
        text: str,
        token_ids: tuple[int, ...],
        finish_reason: str | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        num_cached_tokens: int,
        num_computed_tokens: int,
        logprobs: tuple[TokenLogprob, ...],
        error: str | None,
        embedding: tuple[float, ...] | None = None,
        prefix_miss: str | None = None,
        prefix_shared: int = 0,
    ) -> RequestOutput:
        """An output from every one of its fields, made as `RequestState.evolve` makes a
        state: without `__init__`, whose setting of each frozen field cost ~4x as much (the
        request actor makes one a step per request)."""
        new = object.__new__(cls)
        new.__dict__.update(
            request_id=request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=num_output_tokens,
            num_cached_tokens=num_cached_tokens,
            num_computed_tokens=num_computed_tokens,
            logprobs=logprobs,
            error=error,
            embedding=embedding,
            prefix_miss=prefix_miss,
            prefix_shared=prefix_shared,
        )
        return new

    @property
    def is_progress(self) -> bool:
        return not self.token_ids and self.finish_reason is None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the `later` one as one (a client that fell behind gets what it
        missed in one piece)."""
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs,
        )


class IncrementalDetokenizer:
    """Streams text that always equals `decode(all tokens so far)`, never half a character.

    Decodes a short window: the tokens since the last emitted boundary (`prefix`) with and
    without the newest ones (`read`), and emits the difference once it does not end in an
    incomplete UTF-8 sequence. Unlike mlx-lm's streaming detokenizers it keeps a leading
    space, so the stream matches the tokenizer's own `decode`.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been emitted

    def add(self, token_id: int) -> str:
        self._tokens.append(token_id)
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._tokens)
            return after[len(before) :]
        return ""

    def finalize(self) -> str:
        """Whatever is left (an incomplete character decodes as U+FFFD, as decode does)."""
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        self._prefix = self._read = len(self._tokens)
        return after[len(before) :]


class StreamDetokenizer:
    """The stream `IncrementalDetokenizer` gives, from the Rust tokenizer's own incremental
    decoder (`tokenizers.decoders.DecodeStream`, which also holds back half a character):
    one call a token. For a tokenizer whose `decode` is the Rust one's (`detokenizers`)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._tokens: list[int] = []
        self._emitted = 0  # characters of text given out
        self._holding = False  # the last tokens are part of a character, not yet given out

    def add(self, token_id: int) -> str:
        self._tokens.append(token_id)
        text = self._stream.step(self._tokenizer, token_id)
        self._holding = text is None
        if text is None:
            return ""
        self._emitted += len(text)
        return text

    def finalize(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD, as decode does)."""
        if not self._holding:
            return ""
        self._holding = False
        whole = self._tokenizer.decode(self._tokens, skip_special_tokens=False)
        rest, self._emitted = whole[self._emitted :], len(whole)
        return rest


class Detokenizer(Protocol):
    """A request's streaming detokenizer: the text of each new token (what can be shown of
    it), and at the end what was held back."""

    def add(self, token_id: int) -> str: ...

    def finalize(self) -> str: ...


class StopMatcher:
    """Finds stop strings in streamed text; holds back text that may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        if not self.stops:
            return text, False
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        self._held = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class RequestActor:
    """One request's actor: turns the step loop's per-step `Update`s into the client's
    `RequestOutput`s (one per update that has something to say), then closes the client's
    mailbox after the last."""

    def __init__(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        stop: tuple[str, ...],
        detokenizer: Detokenizer,
        inbox: Mailbox[Update] | None,  # None: the step loop drives it (`take`)
        output: Mailbox[RequestOutput],
        on_end: Callable[[FinishReason], None] = lambda reason: None,
        keep: object = None,
    ):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0  # the step loop says otherwise when its first chunk runs
        self.prefix_miss: str | None = None  # ... and why its hit stops there
        self.prefix_shared = 0
        self._detok = detokenizer
        self._stops = StopMatcher(stop)
        self.inbox = self._inbox = inbox
        self.output = self._output = output  # the client's mailbox
        self._on_end = on_end  # tells the step loop the actor ended the request itself
        # Held until the request ends: its compiled grammar, which the executor then finds
        # compiled when it admits the request (`GrammarCompiler.hold`).
        self._keep = keep
        self._num_output_tokens = 0  # the core's count, from the last update
        self._log = log.bind(request_id=request_id)

    def _out(
        self,
        text: str,
        token_ids: tuple[int, ...] = (),
        finish: FinishReason | None = None,
        *,
        num_computed_tokens: int = 0,
        logprobs: tuple[TokenLogprob, ...] = (),
        error: str | None = None,
        embedding: tuple[float, ...] | None = None,
    ) -> RequestOutput:
        return RequestOutput.made(
            self.request_id,
            text,
            token_ids,
            None if finish is None else str(finish),
            self.num_prompt_tokens,
            self._num_output_tokens,
            self.num_cached_tokens,
            num_computed_tokens,
            logprobs,
            error,
            embedding,
            self.prefix_miss,
            self.prefix_shared,
        )

    def on_update(self, update: Update) -> RequestOutput | None:
        """The output for one step's update: its text, its prompt's progress, or its end
        (None when it says nothing new to the client)."""
        if update.num_cached_tokens is not None:
            self.num_cached_tokens = update.num_cached_tokens
        if update.prefix_miss is not None:
            self.prefix_miss, self.prefix_shared = update.prefix_miss, update.prefix_shared
        self._num_output_tokens = update.num_output_tokens
        if update.token_ids:
            try:
                return self._on_tokens(update)
            except Exception as exc:  # a detokenizer bug ends this request only
                self._log.exception("request_actor_failed")
                self._on_end(FinishReason.ERROR)
                return self._out("", finish=FinishReason.ERROR, error=repr(exc))
        if update.finish is not None:
            return self._out(
                "", finish=update.finish, error=update.message, embedding=update.embedding
            )
        if 0 < update.num_computed_tokens < self.num_prompt_tokens:
            return self._out("", num_computed_tokens=update.num_computed_tokens)
        return None

    def _on_tokens(self, update: Update) -> RequestOutput:
        tokens = update.token_ids
        printable = tokens[:-1] if update.stop_token else tokens
        if len(printable) == 1:  # a decode step's one token
            text = self._detok.add(printable[0])
        else:
            text = "".join([self._detok.add(t) for t in printable])
        finish = update.finish
        if finish is not None:
            text += self._detok.finalize()
        text, hit = self._stops.feed(text)
        if hit and finish is None:
            finish = FinishReason.STOP
            self._on_end(FinishReason.STOP)  # tokens computed meanwhile are never shown
        elif hit:
            finish = FinishReason.STOP
        elif finish is not None:
            text += self._stops.flush()  # a partial stop string at the end is ordinary text
        return self._out(
            text,
            tuple(tokens),
            finish,
            num_computed_tokens=self.num_prompt_tokens,
            logprobs=tuple(update.logprobs),
        )

    def close(self) -> None:
        """Close its inbox and the client's mailbox (a request that was never admitted)."""
        if self._inbox is not None:
            self._inbox.close()
        self._output.close()

    def take(self, update: Update) -> FinishReason | None:
        """One update, where the step loop drives this actor (`Submit.actor`: a request with
        stop strings, whose stop must end it in the step that found it): the client gets its
        output now. Returns how this actor ended the request itself (a stop string, a
        detokenizer fault), for the loop to record at once; None if it did not."""
        out = self.on_update(update)
        if out is None:
            return None
        self._output.put(out)
        if out.finish_reason is None:
            return None
        self._output.close()
        self._keep = None  # its grammar is no longer needed
        return FinishReason(out.finish_reason) if update.finish is None else None

    def put(self, update: Update) -> bool:
        """`take`, as an inbox's `put` (the loop's end of a request outside a step)."""
        self.take(update)
        return True

    async def run(self) -> None:
        """Serve the inbox until the request ends; then close the client's mailbox."""
        assert self._inbox is not None, "the step loop drives this actor"
        try:
            while True:
                try:
                    update = await self._inbox.get()
                except anyio.EndOfStream:  # the engine is closing
                    return
                out = self.on_update(update)
                if out is None:
                    continue
                self._output.put(out)  # a client that left: its Cancel is on the way
                if out.finish_reason is not None:
                    return
        finally:
            self._inbox.close()
            self._output.close()
