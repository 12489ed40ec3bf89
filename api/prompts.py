"""Prompts into token ids: the chat template, the tokenizer, and the chat boundaries that
become prefix-cache checkpoints. Pure CPU, no MLX: a long prompt is prepared on a worker
thread, and a text whose length alone proves it too long for the context is refused unread.

Text that came from a client is tokenized as text: only the chat template's own markup makes
special tokens. A user message holding `<|im_end|>\n<|im_start|>system\n...` would otherwise
be tokenized as a real turn of the conversation (role injection; mlx-lm's server and vLLM
tokenize the whole rendering as it is). Where a client's string (a message's content, a tool's
description, a template argument) holds the text of one of the tokenizer's added tokens, that
text is rendered as a placeholder, and the rendering is tokenized around it with the text
tokenized as plain text in its place (`_guarded`). Raw prompts (`prompt=`) are the client's
whole prompt and are tokenized as they are.

Images (a vision model's prompts): a message's content may hold `{"type": "image", "image":
...}` parts (`ImageData` from a door, or an image file's bytes from the Python API). The chat
template renders each as the model's placeholder; the rendering is tokenized around them and
each image's own token span (its markers and placeholder tokens, the model family's:
`engine/vision/`) goes in its place, with what its vision encoder reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import tokenizers
from jinja2 import TemplateError

from stepline.actors.request import Detokenizer, IncrementalDetokenizer, StreamDetokenizer
from stepline.actors.scheduler.admission import ContextLengthExceededError, embedding_too_long
from stepline.actors.scheduler.spans import PromptImage
from stepline.api.request_error import RequestError
from stepline.api.resent import as_resent, common_prefix
from stepline.engine.audio import AudioData, AudioError, decode_audio, no_audio
from stepline.engine.images import (
    ImageData,
    ImageError,
    decode_image,
    text_only,
)
from stepline.engine.media import place

MAX_CONCURRENT_PREPARE = 4  # prompts tokenized at once, each on a worker thread
# Where a client's text held an added token's text: private-use characters no template
# writes and no tokenizer is given (the rendering is split at them).
_HOLE = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class Prepared:
    """A prompt ready to submit: its token ids, its chat checkpoints, and its images."""

    ids: list[int]
    checkpoints: list[int]
    images: tuple[PromptImage, ...] = ()


class PromptTooLongError(ContextLengthExceededError):
    """The prompt's text alone proves it longer than the context: `num_prompt_tokens` is a
    lower bound, found without tokenizing it (`embedding`: of an embedding's input)."""

    def __init__(self, num_prompt_tokens: int, max_context: int, *, embedding: bool = False):
        super().__init__(num_prompt_tokens, max_context, embedding=embedding)
        if embedding:
            message = embedding_too_long(f"at least {num_prompt_tokens}", max_context)
        else:
            message = (
                f"the prompt has at least {num_prompt_tokens} tokens but the model's context is "
                f"{max_context} tokens: shorten the prompt"
            )
        self.args = (message,)


def detokenizers(tokenizer: Any) -> Callable[[], Detokenizer]:
    """A factory of request actors' detokenizers (one per request) for `tokenizer`.

    Where the tokenizer's own `decode` is exactly the Rust tokenizer's — a plain
    `tokenizers`-backed tokenizer with no clean-up of spaces and no `decode` of its own
    (mlx-lm's NewlineTokenizer has one) — the Rust tokenizer's own incremental decoder
    (`StreamDetokenizer`): one call a token, ~0.7 us, where decoding twice through
    transformers' wrapper cost ~5.5 us and twice straight from Rust ~1.8 us. Any other
    tokenizer streams with `IncrementalDetokenizer` over its `decode`.
    """
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # under mlx-lm's TokenizerWrapper
    backend = getattr(hf, "_tokenizer", None)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
    except ImportError:  # transformers < 5
        from transformers import PreTrainedTokenizerFast as Fast
    plain = (
        getattr(type(hf), "decode", None) is PreTrainedTokenizerBase.decode
        and getattr(type(hf), "_decode", None) is Fast._decode
        and getattr(hf, "clean_up_tokenization_spaces", True) is False
        and isinstance(backend, tokenizers.Tokenizer)
    )
    if plain:
        return lambda: StreamDetokenizer(backend)
    return lambda: IncrementalDetokenizer(tokenizer.decode)


class Prompts:
    """Token ids for one tokenizer (an mlx-lm TokenizerWrapper or anything with `encode`,
    `apply_chat_template` and `get_vocab`) and a model of `max_context` tokens."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_context: int,
        images: Any = None,
        audio: Any = None,
        exact_prefixes: bool = False,
    ):
        self.tokenizer = tokenizer
        # the model's cache serves a prefix only where it was snapshotted (recurrent layers,
        # sliding windows: `ModelLimits.exact_prefixes`): chats get one more checkpoint
        self.exact_prefixes = exact_prefixes
        # a vision model's image prompts (`engine.vision.idefics3.Idefics3Images`, ...);
        # None: text only
        self.images = images
        # an audio model's clip prompts (`engine.audio_model.Phi4mmAudio`); None: no audio
        self.audio = audio
        self.vocab_size = vocab_size
        self.max_context = max_context
        self._max_chars_per_token: int | None = None
        self._specials: list[tuple[int, str]] | None = None
        self._added: re.Pattern[str] | None | bool = False  # not looked at yet
        self._plain: Any = None  # the tokenizer with added tokens' text taken as text
        self._limiter = anyio.CapacityLimiter(MAX_CONCURRENT_PREPARE)

    def prepare(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prepared:
        """A prompt's token ids, its chat checkpoints (none for a raw prompt) and its images
        (the messages' image parts, each with its token span): the chat
        template is rendered once for the whole conversation (and once for each boundary's
        prefix), and the whole is tokenized once (a boundary's prefix again only when no
        special token follows it). `template_kwargs` (`tools`, `enable_thinking`, ...) go to
        every rendering.

        CPU work that can take seconds for a long prompt: `prepare_async` runs it off the event
        loop. Raises RequestError (a ValueError) for a malformed prompt or messages (a
        template's own error included), PromptTooLongError when the text is too long for the
        context even before it is tokenized, and ImageError for an image part a text model
        cannot read or bytes that are not an image.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt= or messages=")
        if messages is not None:
            messages, images = self._take_images(messages)
            text, holes = self._render(messages, template_kwargs)
            self.check_text_length(text)
            if images:
                ids, spans = self._encode_images(text, holes, images)
            else:
                ids, spans = self._encode(text, holes), ()
            return Prepared(ids, self.chat_checkpoints(messages, ids, text, template_kwargs), spans)
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            return Prepared(list(self.tokenizer.encode(prompt)), [])
        ids = list(prompt)  # type: ignore[arg-type]
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(
                    f"token id {t!r} is not in the model's vocabulary (0..{vocab - 1})"
                )
        return Prepared(ids, [])

    def _take_images(self, messages: Sequence[dict]) -> tuple[Sequence[dict], list[Any]]:
        """The messages with each image part as `{"type": "image"}` and each audio part as
        `{"type": "audio"}` (what templates read), and the media, decoded and made into their
        encoder's inputs, one at a time (so that one image's decoded pixels are held at
        once), in order (`ImageData` and `AudioData`). Raises ImageError for an image sent
        to a text model, and for bytes that are not an image; AudioError likewise."""
        images: list[Any] = []
        out: list[dict] | None = None
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list) or not any(
                isinstance(p, dict) and p.get("type") in _MEDIA for p in content
            ):
                continue
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _MEDIA:
                    where = f"messages.{i}.content.{j}"
                    image = (
                        self._image(part.get("image"), where)
                        if kind == "image"
                        else self._clip(part.get("audio"), where)
                    )
                    images.append(image)
                    part = {k: v for k, v in part.items() if k != kind}
                parts.append(part)
            if out is None:
                out = list(messages)
            out[i] = {**m, "content": parts}
        return (messages if out is None else out), images

    def _image(self, value: Any, where: str) -> ImageData:
        if self.images is None:
            raise text_only(where)
        image = _image_data(value, where)
        if image.expanded is None:  # its encoder inputs at once, its pixels let go
            image = image.with_inputs(self.images.expand(image))
        return image

    def _clip(self, value: Any, where: str) -> AudioData:
        if self.audio is None:
            raise no_audio(where)
        clip = _audio_data(value, where, self.audio.rate)
        if clip.expanded is None:  # its encoder inputs at once, its samples let go
            clip = clip.with_inputs(self.audio.expand(clip))
        return clip

    def _encode_images(
        self, text: str, holes: list[str], images: list[Any]
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The ids of a rendering with a placeholder for each of `images` (images and clips,
        in order): the text around them as `_encode`, each span (`Expanded.text`,
        tokenized) in its place. Raises RequestError if the template did not render one
        placeholder per image and per clip, in their order."""
        marks = [p.placeholder for p in (self.images, self.audio) if p is not None]
        split = re.split("(" + "|".join(re.escape(m) for m in marks) + ")", text)
        pieces, found = split[::2], split[1::2]
        wanted = [_placeholder_of(self, image) for image in images]
        if found != wanted:
            what = ", ".join(f"{n} {k}" for k, n in _counts(images).items())
            raise RequestError(
                f"the chat template rendered {len(found)} media placeholders for {what}: this "
                "model's template cannot show these here"
            )
        if holes:
            _check_holes(text, holes)
        ids: list[int] = []
        spans: list[PromptImage] = []
        expansions = [image.expanded for image in images]
        for k, piece in enumerate(pieces):
            # the text the family writes around a span goes with the text beside it
            if k > 0:
                piece = expansions[k - 1].trail + piece
            if k < len(images):
                piece += expansions[k].lead
            if piece:
                ids += (
                    self._encode_around(piece, holes, whole=False)
                    if holes
                    else self._encode(piece, holes)
                )
            if k < len(images):
                span, placed = place(expansions[k], images[k], self.tokenizer, len(ids))
                spans.append(placed)
                ids += span
        return ids, tuple(spans)

    def _render(
        self,
        messages: Sequence[dict],
        template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool = True,
    ) -> tuple[str, list[str]]:
        """The chat template's rendering of `messages` with the added tokens' text in
        clients' strings as placeholders (`_guarded`), and the texts they stand for. The
        template's arguments are walked first (templates render tools before the turns), so a
        prefix of the conversation renders to a prefix of the whole."""
        holes: list[str] = []
        template_kwargs, messages = self._guarded((template_kwargs, messages), holes)
        return self.render_chat(messages, add_generation_prompt, template_kwargs), holes

    def _encode(self, text: str, holes: list[str]) -> list[int]:
        """The ids of a rendering (`_render`)."""
        if holes:
            return self._encode_around(text, holes)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _guarded(self, value: Any, holes: list[str]) -> Any:
        """`value` (messages and template arguments: nested dicts, lists, strings) with each
        added token's text in a string replaced by a placeholder; the texts replaced are
        appended to `holes`, the placeholder's number their index. The same objects where
        nothing is replaced."""
        pattern = self._added_tokens()
        if pattern is None:
            return value

        def hole(match: re.Match[str]) -> str:
            holes.append(match.group())
            return f"\ue000{len(holes) - 1}\ue001"

        def walk(v: Any) -> Any:
            if isinstance(v, str):
                return pattern.sub(hole, v) if pattern.search(v) else v
            if isinstance(v, dict):
                out = {k: walk(x) for k, x in v.items()}
                return v if all(out[k] is v[k] for k in v) else out
            if isinstance(v, list | tuple):
                items = [walk(x) for x in v]
                same = all(a is b for a, b in zip(items, v, strict=True))
                return v if same else type(v)(items)
            return v

        return walk(value)

    def _encode_around(self, text: str, holes: list[str], *, whole: bool = True) -> list[int]:
        """The ids of `text`, a rendering with placeholders where `holes` were: the text
        between them tokenized as usual (the template's special tokens included), each hole's
        text as plain text. A special token the tokenizer splits at stood at each hole, so the
        pieces meet where the whole would have been split anyway. Raises RequestError if the
        template did not carry every placeholder through as it was (it escaped it); `whole`:
        `text` is all of the rendering (else a piece of it, checked as a whole already)."""
        if whole:
            _check_holes(text, holes)
        pieces = _HOLE.split(text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self._plain_ids(holes[int(piece)])
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def _added_tokens(self) -> re.Pattern[str] | None:
        """A pattern of the text of every token added to the vocabulary (special or not:
        the tokenizer turns either into its id wherever the text stands), longest first."""
        if self._added is False:
            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            decoder = getattr(hf, "added_tokens_decoder", None) or {}
            texts = sorted(
                {t.content for t in decoder.values() if t.content.strip()}, key=len, reverse=True
            )
            self._added = re.compile("|".join(map(re.escape, texts))) if texts else None
        return self._added  # type: ignore[return-value]

    def _plain_ids(self, text: str) -> list[int]:
        """`text`'s ids with the added tokens' text in it tokenized as ordinary text, special
        or not (Qwen3's `<think>` and `<tool_call>` are not special, and its parsers and
        template give them meaning all the same)."""
        if self._plain is None:
            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            backend = getattr(hf, "_tokenizer", None) or getattr(hf, "backend_tokenizer", None)
            if isinstance(backend, tokenizers.Tokenizer):
                plain = _without_added_tokens(backend)
                self._plain = lambda t: plain.encode(t, add_special_tokens=False).ids
            else:  # a Python tokenizer: transformers' switch skips every added token
                self._plain = lambda t: hf(t, add_special_tokens=False, split_special_tokens=True)[
                    "input_ids"
                ]
        return list(self._plain(text))

    async def prepare_async(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prepared:
        """`prepare` on a worker thread (tokenizers are pure CPU, no MLX, and release the GIL
        while they encode), at most `MAX_CONCURRENT_PREPARE` at once."""
        return await anyio.to_thread.run_sync(
            self.prepare, prompt, messages, template_kwargs, limiter=self._limiter
        )

    @property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token stands for: its longest vocabulary entry
        (byte-level entries spell each byte as one character, so an entry is never shorter
        than its text), times 4 when the tokenizer normalizes text first (Unicode composition
        can merge up to ~4 characters into one)."""
        if self._max_chars_per_token is None:
            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            longest = max((len(k) for k in hf.get_vocab()), default=1)
            backend = getattr(hf, "backend_tokenizer", None)
            normalizes = backend is None or backend.normalizer is not None
            self._max_chars_per_token = max(1, longest) * (4 if normalizes else 1)
        return self._max_chars_per_token

    def check_text_length(self, text: str) -> None:
        # Every token stands for at most max_chars_per_token characters, so a text this long
        # has at least this many tokens: refuse it before spending seconds tokenizing it.
        at_least = -(-len(text) // self.max_chars_per_token)
        if at_least >= self.max_context:
            raise PromptTooLongError(at_least, self.max_context)

    def render_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's rendering of `messages`. Raises RequestError on malformed messages
        (a template that refuses them included)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content'")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise RequestError(f"the chat template refused the messages: {exc}") from exc
        except ValueError as exc:  # the tokenizer's own checks of them (an empty conversation)
            raise RequestError(str(exc)) from exc

    def chat_checkpoints(
        self,
        messages: Sequence[dict],
        ids: Sequence[int],
        text: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token offsets of chat boundaries in `ids`: the end of the system prompt, the end
        of the turns before the last user message, and the end of the prompt itself; for a
        model whose cache serves only where it was snapshotted (`exact_prefixes`), also where
        a reminder the client moves begins (`resent_start`).

        Found from the chat template's rendering of message prefixes; a boundary whose
        tokens are not an exact prefix of `ids` is left out, never guessed. With `text`, the
        rendering of `messages` (`_render`'s), a boundary followed by a special token
        (`<|im_start|>`) is found without tokenizing its prefix again (`_split_offset`).
        """
        cuts = set()
        if messages and messages[0].get("role") in ("system", "developer"):
            cuts.add(1)
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if users and users[-1] > 0:
            cuts.add(users[-1])
        found = [len(ids)]
        for n in sorted(cuts):
            try:
                prefix_text, holes = self._render(
                    messages[:n], template_kwargs, add_generation_prompt=False
                )
            except Exception:  # noqa: BLE001 - a template may refuse a partial chat
                continue
            if text is not None:
                if not text.startswith(prefix_text):
                    continue
                k = self._split_offset(text, ids, len(prefix_text))
                if k is not None:
                    if 0 < k < len(ids):
                        found.append(k)
                    continue
            prefix = self._encode(prefix_text, holes)
            if 0 < len(prefix) < len(ids) and list(ids[: len(prefix)]) == prefix:
                found.append(len(prefix))
        if self.exact_prefixes and (start := self.resent_start(messages, ids, template_kwargs)):
            found.append(start)
        return found

    def resent_start(
        self,
        messages: Sequence[dict],
        ids: Sequence[int],
        template_kwargs: dict[str, Any] | None = None,
    ) -> int | None:
        """Where the tokens of `messages` (`ids`) part from those of the same history as the
        client sends it back next turn (`resent.as_resent`: without the reminder it moves),
        where that is inside the prompt; None where the client rewrites nothing. The next
        request shares the prompt up to there, whatever its own new messages are, so where
        its prefilled next turn (api/pipeline/next_turn.py) is late or missed, a recurrent
        cache still serves it from there rather than from the newest user message's start
        (before the tool results it carries)."""
        resent = as_resent(messages)
        same = len(resent) == len(messages)
        if same and all(a is b for a, b in zip(resent, messages, strict=True)):
            return None
        try:
            text, holes = self._render(resent, template_kwargs, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template may refuse the shorter chat
            return None
        k = common_prefix(ids, self._encode(text, holes))
        return k if 0 < k < len(ids) else None

    def _split_offset(self, text: str, ids: Sequence[int], at: int) -> int | None:
        """The number of tokens of `text[:at]` within `ids` (the tokens of `text`), when a
        special token starts at `at`; None otherwise.

        A tokenizer splits its input at special tokens first and tokenizes the pieces between
        them on their own, so the tokens before the special token at `at` are exactly those of
        `text[:at]`; and each occurrence of its text before `at` is one of its ids in `ids`.
        """
        for token_id, content in self._special_tokens():
            if text.startswith(content, at):
                nth = text.count(content, 0, at)
                seen = 0
                for k, t in enumerate(ids):
                    if t == token_id:
                        if seen == nth:
                            return k
                        seen += 1
                return None
        return None

    def _special_tokens(self) -> list[tuple[int, str]]:
        """(id, text) of the special tokens the tokenizer splits text at as they are (not
        normalized, not eating the whitespace before them); none when one's text contains
        another's (then counting occurrences could miscount)."""
        if self._specials is None:
            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            decoder = getattr(hf, "added_tokens_decoder", None) or {}
            specials = [
                (token_id, tok.content)
                for token_id, tok in decoder.items()
                if getattr(tok, "special", False)
                and tok.content
                and not getattr(tok, "lstrip", True)
                and not getattr(tok, "normalized", True)
            ]
            texts = [content for _, content in specials]
            nested = any(a != b and a in b for a in texts for b in texts)
            self._specials = [] if nested else specials
        return self._specials


def _without_added_tokens(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy of `backend` that knows no added token: their text goes through the normalizer,
    the pre-tokenizer and the model like any other (`encode_special_tokens` would split only
    the special ones)."""
    data = json.loads(backend.to_str())
    data["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(data))


def _check_holes(text: str, holes: list[str]) -> None:
    """Raise RequestError unless a rendering carried each hole's placeholder through as it was
    (a template that escaped it would show the client's text differently)."""
    if sorted(int(n) for n in _HOLE.findall(text)) != list(range(len(holes))):
        raise RequestError(
            "the messages hold the text of the model's special tokens "
            f"({', '.join(sorted(set(holes)))}), which this model's chat template cannot "
            "show as text: remove it"
        )


_MEDIA = ("image", "audio")  # content parts a model's encoders read


def _placeholder_of(prompts: Prompts, medium: Any) -> str:
    family = prompts.audio if isinstance(medium, AudioData) else prompts.images
    return family.placeholder


def _counts(media: Sequence[Any]) -> dict[str, int]:
    clips = sum(isinstance(m, AudioData) for m in media)
    out = {"images": len(media) - clips, "audio clips": clips}
    return {k: n for k, n in out.items() if n}


def _audio_data(value: Any, where: str, rate: int) -> AudioData:
    """An audio part's clip: as a door decoded it (at the model's `rate`), or a WAV, MP3 or
    FLAC file's bytes (Python API). Raises AudioError for anything else."""
    if isinstance(value, AudioData) and value.rate == rate:
        return value
    if isinstance(value, AudioData):
        value = value.data
    if isinstance(value, bytes | bytearray | memoryview):
        return decode_audio(bytes(value), where=where, rate=rate)
    raise AudioError(
        f"{where}.audio must be a WAV, MP3 or FLAC file's bytes, got {type(value).__name__}",
        param=where,
    )


def _image_data(value: Any, where: str) -> ImageData:
    """An image part's image: as a door decoded it, or an image file's bytes (Python API).
    Raises ImageError for anything else."""
    if isinstance(value, ImageData):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return decode_image(bytes(value), where=where)
    raise ImageError(
        f"{where}.image must be an image file's bytes (PNG, JPEG, WebP, GIF), got "
        f"{type(value).__name__}",
        param=where,
    )
