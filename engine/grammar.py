"""Grammars for constrained decoding (llguidance), compiled once each and shared. MLX-free.

A request's constraint travels as an llguidance grammar string (`RequestParams.grammar`), so
the event log records it and re-execution decodes under the same grammar. `GrammarCompiler`
turns a grammar into a pristine `LLMatcher` once (cached by the grammar text, thread-safe);
each request gets a cheap `deep_copy` of it whose state advances with that request's tokens.
The API compiles in a worker thread at submission, so neither the step loop nor the executor
waits for a compile; the executor's lookup is then a cache hit (the API holds the compiled
grammar until the request ends, so that the cache cannot let it go before its admission).

Every matcher runs under `LIMITS`, llguidance's own bounds on a grammar's size and on the
work one mask may take, so one request's grammar cannot hold a step for seconds. Compiling a
grammar also runs its first steps (`_check_start`): a grammar that fails there (a `$ref`
loop that admits no value, a pattern or a recursion past the limits) is refused at
submission. One that fails later puts its matcher in llguidance's error state; the executor
checks it after every token and ends that request with an error.

The builders below make grammars from what clients send: a JSON schema (`response_format`),
any JSON object (`json_object`), or a forced tool call in the chat template's
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` format (`tool_choice`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON: no free whitespace between tokens. A model can still emit any value; it only
# cannot pad (an unconstrained-whitespace grammar lets a weak model emit blanks forever).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile, or cannot follow within `LIMITS`; the
    message says what is wrong."""


# llguidance's limits (`LLParserLimits`), for every matcher. Their unit is fuel, not time, so
# whether a grammar fits does not depend on how busy the machine is. Measured on a shared
# 2-core Linux machine, SmolLM2's 49k vocabulary (llguidance quotes a fast machine's speeds,
# about 5x ours):
# - step_lexer_fuel, step_max_items: the work of one mask (and of taking in one token), inside
#   a step. Ordinary schemas use at most 6k fuel and 30 items a step after their first; a
#   string `pattern` of a{10000} reached mid-output took 154 ms a mask at llguidance's
#   defaults (200k, 50k) and takes 11 ms at these, a recursion the grammar can never close
#   62 ms before failing and 25 ms.
# - initial_lexer_fuel: the lexer's set-up, spent by a grammar's first mask, which
#   `_check_start` computes at compile time, off the step. llguidance's default: an `anyOf`
#   of 1,500 objects needs 770k of it (0.1-0.4 s).
# - max_items_in_row, max_lexer_states, max_grammar_size: the size of what a grammar may
#   build; llguidance's defaults (an `anyOf` of more than 2,000 objects is past the first).
LIMITS = llguidance.LLParserLimits(
    step_lexer_fuel=50_000,
    step_max_items=20_000,
    initial_lexer_fuel=1_000_000,
    max_items_in_row=2_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
    verbose_errors=False,  # errors reach clients: the reason, not the parser's state
)
# The longest a client waits for its grammar to compile (the tokenizer's one-time set-up
# aside), past which it is refused as too complex. A backstop: `LIMITS` bound the work (a
# grammar at the edge of initial_lexer_fuel took 1-2.7 s here), this bounds the wait on a
# machine too busy to do it.
COMPILE_TIMEOUT_S = 10.0


def compile_slots() -> int:
    """How many grammars may compile at once: half the cores (at least one)."""
    return max(1, (os.cpu_count() or 2) // 2)


# How many tokens `_check_start` tries at most, where the grammar leaves at most
# `_FEW_STARTS` tokens to choose from (where it leaves more, the model's choice decides).
_PROBE_TOKENS = 16
_FEW_STARTS = 4


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON documents valid under `schema`. Raises GrammarError if malformed."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc


def markup(tokenizer: Any, text: str) -> str:
    """`text` as a Lark terminal: the token itself (`<[id]>`) when the tokenizer has it as one
    added token (llguidance treats every added token as special, never as its letters), else
    the quoted text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    if len(ids) == 1 and added.get(text) == ids[0]:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_call_grammar(
    tools: Sequence[tuple[str, dict[str, Any]]],
    *,
    start: str = '"<tool_call>"',
    end: str = '"</tool_call>"',
    parallel: bool = True,
) -> str:
    """One tool call (or several, if `parallel`) of one of `tools` ((name, parameters schema)),
    each `start\\n{"name": NAME, "arguments": {...}}\\nend`, the format of Qwen-style templates
    and of mlx-lm's `json_tools` parser. `start` and `end` are Lark terminals (see `markup`).
    Raises GrammarError for a malformed schema."""
    if not tools:
        raise GrammarError("no tool to call: `tools` is empty")
    return answer_grammar(CallFormat(tuple(tools), start, end, parallel), must_call=True)


@dataclass(frozen=True)
class CallFormat:
    """The tool calls an answer may make: `tools` ((name, parameters schema)), each call
    `start\\n{"name": NAME, "arguments": {...}}\\nend` (Lark terminals, see `markup`), one
    or several (`parallel`, separated by a newline)."""

    tools: tuple[tuple[str, dict[str, Any]], ...]
    start: str
    end: str
    parallel: bool = True


@dataclass(frozen=True)
class ThinkFormat:
    """A think block of at most `budget` tokens before the answer: `open` and `close` are its
    Lark terminals (single tokens, see `markup`); `opened`: the prompt already opened it."""

    open: str
    close: str
    budget: int
    opened: bool = False


def _embedded(schema: Any, at: str, prefix: str, defs: dict[str, Any]) -> Any:
    """`schema` (a tool's parameters, written as a document of its own) as it reads at JSON
    pointer `at` inside a larger one: its `$defs` / `definitions` move into `defs` under
    names starting with `prefix` (two tools may each define a `Point`), and its `$ref`s are
    rewritten to match: `#/$defs/X` to the moved definition, any other pointer into it (`#`,
    `#/properties/...`) to the same place under `at`. pydantic writes nested models this way,
    and an embedded `#/$defs/X` would otherwise point at the outer document."""
    moved = {
        **(schema.get("definitions") or {} if isinstance(schema, dict) else {}),
        **(schema.get("$defs") or {} if isinstance(schema, dict) else {}),
    }

    def ref(target: str) -> str:
        for section in ("#/$defs/", "#/definitions/"):
            if target.startswith(section):
                name, _, rest = target[len(section) :].partition("/")
                return f"#/$defs/{prefix}{name}" + (f"/{rest}" if rest else "")
        if target == "#" or target.startswith("#/"):
            return at + target[1:]
        return target  # a URL: left to the grammar engine (which refuses it, naming it)

    def walk(value: Any, top: bool = False) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        out = {}
        for key, v in value.items():
            if top and key in ("$defs", "definitions"):
                continue
            out[key] = ref(v) if key == "$ref" and isinstance(v, str) else walk(v)
        return out

    for name, definition in moved.items():
        defs[f"{prefix}{name}"] = walk(definition)
    return walk(schema, top=True)


def answer_grammar(
    calls: CallFormat | None = None,
    *,
    must_call: bool = False,
    schema: dict[str, Any] | None = None,
    think: ThinkFormat | None = None,
) -> str:
    """The grammar of a whole answer: tool calls of `calls` (required if `must_call`), or
    else a JSON document valid under `schema` (when given), or else free text; after a think
    block bounded by `think`, if given (once its budget is spent only its closing tag may
    follow). Raises GrammarError if there is nothing to constrain or a schema is malformed."""
    rules: list[str] = []
    answers: list[str] = []
    if calls is not None and calls.tools:
        one = len(calls.tools) == 1
        defs: dict[str, Any] = {}
        alternatives = []
        for i, (name, parameters) in enumerate(calls.tools):
            at = "#/properties/arguments" if one else f"#/anyOf/{i}/properties/arguments"
            arguments = _embedded(parameters or {"type": "object"}, at, f"t{i}_", defs)
            alternatives.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        body = alternatives[0] if one else {"anyOf": alternatives}
        if defs:
            body = {**body, "$defs": defs}
        repeat = 'call ("\\n" call)*' if calls.parallel else "call"
        rules += [
            f"calls: {repeat}",
            f'call: {calls.start} "\\n" args "\\n" {calls.end}',
            f"args: %json {_json_body(body)}",
        ]
        answers.append("calls")
    if not must_call:
        if schema is not None:
            rules.append(f"doc: %json {_json_body(schema)}")
            answers.append("doc")
        elif calls is not None or think is not None:
            rules.append("free: <[*]>*")
            answers.append("free")
    if not answers:
        raise GrammarError("nothing to constrain: no tool to call and no schema")
    rules.append("answer: " + " | ".join(answers))
    if think is None:
        start = "answer"
    else:
        rules += [
            f"thinking[max_tokens={think.budget}]: /(.|\\n)*/",
            "BLANK: /[ \\t\\r\\n]+/",
            f"think_end: thinking {think.close} BLANK?",
        ]
        if think.opened:
            start = "think_end answer"
        else:
            # An answer without a think block may not open one later (the budget would not
            # hold): its free text starts with any token but the opening tag.
            unthought = [a if a != "free" else "unthought" for a in answers]
            if "free" in answers:
                rules.append(f"unthought: (<[^{_token_id(think.open)}]> <[*]>*)?")
            start = f"{think.open} think_end answer | " + " | ".join(unthought)
    lark = "start: " + start + "\n" + "\n".join(rules) + "\n"
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc


def _json_body(schema: dict[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _token_id(terminal: str) -> int:
    """The id in a `<[id]>` terminal. Raises GrammarError for any other terminal."""
    if not (terminal.startswith("<[") and terminal.endswith("]>")):
        raise GrammarError(f"{terminal} is not one token: a think budget needs single-token tags")
    return int(terminal[2:-2])


# What a compiled grammar is counted as holding, per character of its text and token of the
# vocabulary: its lexer keeps vocabulary-wide token sets per state. Measured: a 0.1 MB grammar
# (400 enum properties) held 5.5-5.9 MB once compiled and used, with a 49k vocabulary; this
# counts it as 6.7 MB. An estimate, so that the cache is bounded by bytes and not by count
# alone (60 large schemas once held 2.3 GB).
_BYTES_PER_CHAR_AND_TOKEN = 1 / 768
DEFAULT_CACHE_BYTES = 256 * 2**20


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the most recently used: at most
    `max_entries` of them, together counted at most `max_bytes` (`grammar_nbytes`; the
    newest is kept even alone past it).

    `tokenizer` is mlx-lm's TokenizerWrapper (or a Hugging Face fast tokenizer); `vocab_size`
    is the width of the model's logits, which may exceed the tokenizer's. The llguidance
    tokenizer is built on first use (about a second for a 150k vocabulary), not at start-up.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        max_entries: int = 256,
        max_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [self._hf.eos_token_id])
        self._vocab_size = vocab_size
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._nbytes = 0  # of the entries kept, as `grammar_nbytes` counts them
        self._lock = threading.Lock()  # held for lookups only: `find` runs on the event loop
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer is built
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, Compiled] = OrderedDict()
        # Every grammar compiled and still held by someone (a request not yet admitted), kept
        # or not: the executor finds it here, and never compiles inside a step.
        self._held: weakref.WeakValueDictionary[str, Compiled] = weakref.WeakValueDictionary()
        # The digests of the latest grammars refused, with why: a refusal depends on fuel, not
        # time, so the same grammar again is refused without compiling it again.
        self._refused: OrderedDict[bytes, str] = OrderedDict()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (once), so that timing a compile leaves it out."""
        self._tokenizer()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The pristine matcher of `grammar`, compiled now or found in the cache.

        Raises GrammarError if llguidance refuses the grammar, or it fails at its start.
        """
        return self.hold(grammar).matcher

    def hold(self, grammar: str) -> Compiled:
        """`grammar` compiled (as `compile`), in a handle that keeps it compiled while
        anyone holds it, however many grammars the cache meets meanwhile. Raises
        GrammarError."""
        hit = self.find(grammar)
        if hit is not None:
            return hit
        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            refused = self._refused.get(key)
        if refused is not None:
            raise GrammarError(refused)
        try:
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=LIMITS)
            if matcher.is_error():
                raise GrammarError(_refusal("the grammar does not compile", matcher.get_error()))
            _check_start(matcher, self._vocab_size)
        except GrammarError as exc:
            with self._lock:
                self._refused[key] = str(exc)
                while len(self._refused) > self._max_entries:
                    self._refused.popitem(last=False)
            raise
        compiled = Compiled(matcher)
        with self._lock:
            self._held[grammar] = compiled
            self._keep(grammar, compiled)
        return compiled

    def find(self, grammar: str) -> Compiled | None:
        """`grammar` compiled, if it is (as `hold` would return it, held the same way); None
        where it would compile. Quick: it takes the lock for a lookup, never a compile."""
        with self._lock:
            hit = self._compiled.get(grammar) or self._held.get(grammar)
            if hit is None or hit.spent:
                return None
            self._keep(grammar, hit)
            return hit

    def _keep(self, grammar: str, compiled: Compiled) -> None:
        """Make `grammar` the cache's most recently used (under the lock)."""
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return
        self._nbytes += self.grammar_nbytes(grammar)
        self._compiled[grammar] = compiled
        while len(self._compiled) > 1 and (
            len(self._compiled) > self._max_entries or self._nbytes > self._max_bytes
        ):
            dropped, _ = self._compiled.popitem(last=False)
            self._nbytes -= self.grammar_nbytes(dropped)

    def grammar_nbytes(self, grammar: str) -> int:
        """The memory a compiled `grammar` is counted as holding (an estimate: see above)."""
        return int(len(grammar) * self._vocab_size * _BYTES_PER_CHAR_AND_TOKEN)

    @property
    def nbytes(self) -> int:
        """What the kept grammars are counted as holding, together."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for one request (a copy of the compiled one): the executor's lookup
        at admission, which finds what the request holds (spent or not); it compiles only
        where nobody does (a distributed rank, a runner driven directly). Raises
        GrammarError."""
        with self._lock:
            hit = self._held.get(grammar) or self._compiled.get(grammar)
        return (hit or self.hold(grammar)).matcher.deep_copy()

    def forget(self, grammar: str) -> None:
        """A request under `grammar` failed mid-generation. llguidance's copies of a compiled
        grammar share its lexer, which that request may have exhausted: the next submission
        compiles it afresh (requests that hold this one fail at their next mask, with an
        error of their own)."""
        with self._lock:
            kept = self._compiled.pop(grammar, None)
            if kept is not None:
                self._nbytes -= self.grammar_nbytes(grammar)
            for compiled in (kept, self._held.get(grammar)):
                if compiled is not None:
                    compiled.spent = True


class Compiled:
    """A compiled grammar: its pristine `matcher`, copied for each request that uses it."""

    __slots__ = ("__weakref__", "matcher", "spent")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.spent = False  # a request under it failed: see `GrammarCompiler.forget`


def _check_start(matcher: llguidance.LLMatcher, vocab_size: int) -> None:
    """Compute `matcher`'s first mask (llguidance's lexer set-up, which would otherwise land
    in a step: every copy starts from it) and take in the tokens its start leaves little
    choice of, on copies, up to `_PROBE_TOKENS` of them. Raises GrammarError if the grammar
    fails there: one that admits no output ("NoExtension": a `$ref` loop), or one past
    `LIMITS` at its first tokens (a recursion that never closes, a pattern too large to
    lex), which every request under it would hit."""
    bitmask = allocate_token_bitmask(1, vocab_size)
    todo = [matcher]
    tried = 0
    while todo and tried < _PROBE_TOKENS:
        current = todo.pop()
        fill_next_token_bitmask(current, bitmask)
        if current.is_error():
            raise GrammarError(_refusal("the schema cannot be followed", current.get_error()))
        if current.is_stopped():
            continue
        allowed = _allowed(bitmask, vocab_size)
        if len(allowed) > _FEW_STARTS:
            continue
        for token in allowed[: _PROBE_TOKENS - tried]:
            tried += 1
            probe = current.deep_copy()
            if not probe.consume_token(token):
                raise GrammarError(_refusal("the schema cannot be followed", probe.get_error()))
            todo.append(probe)


def _allowed(bitmask: np.ndarray, vocab_size: int) -> list[int]:
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab_size]
    return [int(t) for t in np.flatnonzero(bits)]


def _refusal(what: str, error: str) -> str:
    """A client's message for llguidance's `error`: its first line (what hit which limit),
    said as what the client can change."""
    detail = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if detail.startswith("NoExtension"):
        return (
            f"{what}: no output satisfies it (a $ref that only refers to itself, or "
            "constraints no value can meet)"
        )
    lowered = detail.lower()
    if any(word in lowered for word in ("limit", "fuel", "too many", "too large", "max is")):
        return (
            f"{what}: the schema is too complex for the grammar engine's limits ({detail}); "
            "simplify it (fewer alternatives, shorter counted repetitions, no recursion that "
            "can never end)"
        )
    return f"{what}: {detail}"
