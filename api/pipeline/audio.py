"""The audio clips of a request, from what a door received to checked, decoded data: the one
path under every door. No MLX.

A door's schema turns each audio part into a placeholder, `{"type": "audio", "source":
AudioSource}` (`audio_part`), in the neutral messages' content parts (`images.content_of`
keeps a message with one as parts); `resolve_audio` then replaces every placeholder with
`{"type": "audio", "audio": AudioData}`, the part an audio model's chat template renders as
its audio placeholder (`Prompts`).

Sources: base64 data with its format, as OpenAI's `input_audio` part sends it (`{"data":
BASE64, "format": "wav" | "mp3" | "flac"}`). Everything that can be checked without decoding
(the model hears audio at all, how many clips there are, their formats, their base64 size) is
checked before anything is decoded; decoding (miniaudio, CPU) runs on a worker thread, one
clip at a time, and the clip's encoder inputs are made at once (its samples dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.media import (
    check_encoded_size,
    decoded_base64,
    placeholders,
    resolved,
)
from stepline.engine.audio import (
    AUDIO,
    FORMATS,
    AudioData,
    AudioError,
    AudioLimits,
    decode_audio,
    no_audio,
)


@dataclass(frozen=True)
class AudioSource:
    """One audio part as a door received it, not yet decoded: base64 `data`, the `format` the
    client named, and the request field it came from (`where`, as errors name it)."""

    where: str
    data: str = field(repr=False)
    format: str | None = None


@dataclass(frozen=True)
class AudioOptions:
    """How a server takes audio (ServerConfig's audio limits, and whether its model hears
    audio at all)."""

    accepts_audio: bool = False  # the model has an audio encoder (`Engine.accepts_audio`)
    limits: AudioLimits = AudioLimits()
    rate: int = 16_000  # the model's sample rate: clips are resampled to it
    # the model's encoder inputs of a decoded clip (`engine.audio_model` `expand`): made as
    # soon as it is decoded, and its samples dropped; None: the samples are kept
    expand: Callable[[AudioData], Any] | None = field(default=None, compare=False)


def audio_part(source: AudioSource) -> dict[str, Any]:
    """The placeholder of an audio part in neutral content, until `resolve_audio`."""
    return {"type": "audio", "source": source}


def input_audio_part(value: Any, where: str) -> dict[str, Any]:
    """The placeholder of an `input_audio` part (OpenAI chat's and Responses'), from its
    `input_audio` object (`{"data": BASE64, "format": "wav"}`). Raises APIError for
    anything else."""
    fmt = value.get("format") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise APIError(
            400,
            f'{where}.input_audio must be {{"data": BASE64, "format": "wav"}} (or mp3, flac)',
            param=f"{where}.input_audio",
        )
    if fmt is not None and not isinstance(fmt, str):
        raise APIError(400, f"{where}.input_audio.format must be a string", param=where)
    return audio_part(AudioSource(where, value["data"], fmt))


# data-URL media types -> the clip's format
_DATA_URL_TYPES = {
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/vnd.wave": "wav",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
    "audio/flac": "flac",
    "audio/x-flac": "flac",
}


def audio_url_part(value: Any, where: str) -> dict[str, Any]:
    """The placeholder of an `audio_url` part (as mlx-vlm's and vLLM's servers take it:
    `{"url": "data:audio/wav;base64,..."}`, or the URL itself). A data URL only: audio URLs
    are not fetched. Raises APIError for anything else."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise APIError(
            400,
            f'{where}.audio_url must be {{"url": "data:audio/wav;base64,..."}}',
            param=f"{where}.audio_url",
        )
    scheme, _, rest = url.partition(":")
    if scheme.lower() != "data":
        raise APIError(
            400,
            f"{where} is an audio URL: this server does not fetch audio; send the clip as a "
            'data URL (data:audio/wav;base64,...) or an input_audio part ({"data": BASE64, '
            '"format": "wav"})',
            param=where,
            code="audio_url_not_allowed",
        )
    header, comma, payload = rest.partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    fmt = _DATA_URL_TYPES.get(params[0])
    if not comma or "base64" not in params[1:] or fmt is None:
        what = params[0][:40] or "no media type"
        raise APIError(
            400,
            f"{where} is not a base64 audio data URL of WAV, MP3 or FLAC ({what}): send "
            "data:audio/wav;base64,... (or audio/mpeg, audio/flac)",
            param=where,
            code="invalid_audio",
        )
    return audio_part(AudioSource(where, payload, fmt))


async def resolve_audio(
    messages: list[dict[str, Any]], options: AudioOptions
) -> list[dict[str, Any]]:
    """`messages` with each audio placeholder (`audio_part`) replaced by `{"type": "audio",
    "audio": AudioData}`; messages without audio are returned as they are. Before anything is
    decoded: refused if the model has no audio encoder, for more clips than
    `options.limits.max_audios`, and for a format other than wav, mp3 and flac.

    Raises AudioError (`param`: the part's field; `code`: what is wrong):
    `unsupported_content_type`, `too_many_audios`, `unsupported_audio_format`,
    `audio_too_large`, `audio_too_long`, `audio_sample_rate_too_high`, `invalid_audio`."""
    sources = placeholders(messages, AUDIO, AudioSource)
    if not sources:
        return messages
    if not options.accepts_audio:
        raise no_audio(sources[0].where)
    limit = options.limits.max_audios
    if len(sources) > limit:
        raise AUDIO.too_many(len(sources), limit, sources[limit].where)
    for source in sources:
        _check(source, options.limits)
    clips = iter([await anyio.to_thread.run_sync(_decoded, s, options) for s in sources])
    return [resolved(m, AUDIO, AudioSource, clips) for m in messages]


def _check(source: AudioSource, limits: AudioLimits) -> None:
    """What can be said of `source` without decoding it."""
    fmt = source.format
    if fmt is not None and fmt.lower() not in FORMATS:
        raise AudioError(
            f"{source.where} has format {fmt[:40]!r}: send audio as wav, mp3 or flac",
            param=source.where,
            code="unsupported_audio_format",
        )
    check_encoded_size(AUDIO, source.data, source.where, limits.max_bytes)


def _decoded(source: AudioSource, options: AudioOptions) -> AudioData:
    data = decoded_base64(AUDIO, source.data, source.where)
    clip = decode_audio(
        data, where=source.where, rate=options.rate, claimed=source.format, limits=options.limits
    )
    return clip if options.expand is None else clip.with_inputs(options.expand(clip))
