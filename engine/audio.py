"""Audio in prompts, before any model hears it: the bytes a client sent (a WAV, MP3 or FLAC
file), checked against the limits from the file's header, decoded once to mono float samples
at the model's rate, named by their content digest. MLX-free to import; miniaudio (which the
`vision` extra's mlx-vlm brings) is imported only when a clip is decoded.

What an audio model makes of a clip (its token span, its encoder's features) is the model's
business (`engine/audio_model.py`), and where its span sits in a prompt is the scheduler's
(`actors/scheduler/spans.py`, the same spans as images'); here a clip is only validated data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog

from stepline.engine.media import Decoded, MediaError, MediaKind, digest_of

log = structlog.get_logger(__name__)

# Defaults of the limits (ServerConfig's max_audio_bytes, max_audio_seconds,
# max_audio_sample_rate, max_audios_per_request): a 30 s 48 kHz stereo 16-bit WAV is 5.8 MB.
MAX_AUDIO_BYTES = 25 * 2**20
MAX_AUDIO_SECONDS = 60.0
MAX_AUDIO_SAMPLE_RATE = 192_000
MAX_AUDIOS_PER_REQUEST = 4

FORMATS = ("wav", "mp3", "flac")  # what `input_audio.format` may say


class AudioError(MediaError):
    """A clip the server will not take: corrupt, unsupported, too long or too many. `param`
    names where it came from in the request (`messages.0.content.1`), `code` says what is
    wrong (`invalid_audio`, `audio_too_large`, `audio_too_long`, `too_many_audios`, ...)."""

    default_code = "invalid_audio"


AUDIO = MediaKind("audio", AudioError, many="audio clips", one="clip", option="audio")


@dataclass(frozen=True)
class AudioLimits:
    max_bytes: int = MAX_AUDIO_BYTES
    max_seconds: float = MAX_AUDIO_SECONDS
    max_sample_rate: int = MAX_AUDIO_SAMPLE_RATE
    max_audios: int = MAX_AUDIOS_PER_REQUEST


@dataclass(frozen=True)
class AudioData(Decoded):
    """One clip of a prompt, decoded and checked: its bytes as sent, their SHA-256 (what the
    prefix cache and the event log know it by), its length, and its samples (mono float32 at
    the model's rate) until the audio encoder's inputs are made from them."""

    kind: ClassVar[MediaKind] = AUDIO
    decoded_field: ClassVar[str] = "samples"

    data: bytes = field(repr=False)
    digest: str
    format: str  # wav, mp3 or flac, as the bytes say
    seconds: float
    sample_rate: int  # the file's own
    num_samples: int  # at `rate`, what the encoder hears
    rate: int  # the model's sample rate
    # numpy float32 (num_samples,); None once the encoder's inputs are made from it
    samples: Any = field(default=None, repr=False, compare=False)
    # those inputs (`engine.vision.parts.Expanded`), where a door made them as it decoded the clip
    expanded: Any = field(default=None, repr=False, compare=False)

    # what a span's image fields read (`PromptImage.ref`): a clip has no pixels
    width = 0
    height = 0


def no_audio(where: str | None = None) -> AudioError:
    """The error for audio sent to a model without an audio encoder (`where`: the part)."""
    what = f"{where} is audio, but this" if where else "the prompt has audio, but this"
    return AudioError(
        f"{what} server's model has no audio encoder: serve an audio model (such as "
        "stepline-demo-audio, or a Phi-4-multimodal checkpoint) to send audio",
        param=where,
        code="unsupported_content_type",
    )


# What a file is when it is none of FORMATS, for the error (its first bytes).
_OTHER_FORMATS = (
    (b"OggS", 0, "an Ogg (Vorbis or Opus)"),
    (b"\x1a\x45\xdf\xa3", 0, "a WebM or Matroska"),
    (b"ftyp", 4, "an MP4 or M4A"),
    (b"FORM", 0, "an AIFF"),
    (b"#!AMR", 0, "an AMR"),
)


def _other_format(data: bytes) -> str | None:
    for magic, at, name in _OTHER_FORMATS:
        if data[at : at + len(magic)] == magic:
            return name
    return None


def _format_of(data: bytes) -> str | None:
    """wav, mp3 or flac from the first bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def decode_audio(
    data: bytes,
    *,
    where: str,
    rate: int,
    claimed: str | None = None,
    limits: AudioLimits = AudioLimits(),
) -> AudioData:
    """`data` (a WAV, MP3 or FLAC file's bytes) decoded to mono float32 samples at `rate` Hz.
    Checked before any sample is decoded: the bytes (`max_audio_bytes`), the format (the
    one `claimed` by the client, if it said), the file's sample rate
    (`max_audio_sample_rate`) and length (`max_audio_seconds`), from its header.

    Raises AudioError naming `where`: `audio_too_large`, `audio_too_long`,
    `audio_sample_rate_too_high`, `unsupported_audio_format`, and `invalid_audio` for bytes
    that are no such file or do not decode (miniaudio's own text is logged, never shown)."""
    fmt = _checked_format(data, where, claimed, limits)
    info = _checked_header(data, fmt, where, limits)
    samples, num_frames = _samples(data, fmt, info, where, rate)
    return AudioData(
        data=data,
        digest=digest_of(data),
        format=fmt,
        seconds=round(num_frames / info.sample_rate, 6),
        sample_rate=info.sample_rate,
        num_samples=int(samples.size),
        rate=rate,
        samples=samples,
    )


def _checked_format(data: bytes, where: str, claimed: str | None, limits: AudioLimits) -> str:
    """The clip's format from its bytes ("wav", "mp3", "flac"), its size and the format the
    client claimed checked. Raises AudioError as `decode_audio` does."""
    if len(data) > limits.max_bytes:
        raise AudioError(
            f"{where} is {len(data):,} bytes: audio of at most {limits.max_bytes:,} bytes is "
            "served (max_audio_bytes)",
            param=where,
            code="audio_too_large",
        )
    fmt = _format_of(data)
    other = _other_format(data) if fmt is None else None
    if other is not None:
        raise AudioError(
            f"{where} is {other} file, a format this server does not read: send wav, mp3 or flac",
            param=where,
            code="unsupported_audio_format",
        )
    if fmt is None:
        raise AudioError(
            f"{where} is not a WAV, MP3 or FLAC file this server can read (corrupt, or another "
            "format): send wav, mp3 or flac",
            param=where,
        )
    if claimed is not None and claimed.lower() != fmt:
        raise AudioError(
            f"{where} says format {claimed!r} but its bytes are {fmt}: name the clip's own format",
            param=where,
        )
    return fmt


def _checked_header(data: bytes, fmt: str, where: str, limits: AudioLimits) -> Any:
    """The clip's header (miniaudio's info), its sample rate and length checked. Raises
    AudioError as `decode_audio` does."""
    import miniaudio

    try:
        info = {
            "wav": miniaudio.wav_get_info,
            "mp3": miniaudio.mp3_get_info,
            "flac": miniaudio.flac_get_info,
        }[fmt](data)
    except Exception as exc:  # noqa: BLE001 - miniaudio raises DecodeError and others
        log.info("audio_unreadable", where=where, error=f"{type(exc).__name__}: {exc}")
        raise AudioError(
            f"{where} is a {fmt} file whose header cannot be read (corrupt or cut short): send "
            "the whole clip",
            param=where,
        ) from None
    if info.sample_rate > limits.max_sample_rate or info.sample_rate < 1:
        raise AudioError(
            f"{where} is sampled at {info.sample_rate:,} Hz: audio of at most "
            f"{limits.max_sample_rate:,} Hz is served (max_audio_sample_rate)",
            param=where,
            code="audio_sample_rate_too_high",
        )
    seconds = info.num_frames / info.sample_rate
    if seconds > limits.max_seconds:
        raise AudioError(
            f"{where} is {seconds:.1f} s long: clips of at most {limits.max_seconds:g} s are "
            "served (max_audio_seconds)",
            param=where,
            code="audio_too_long",
        )
    return info


def _samples(data: bytes, fmt: str, info: Any, where: str, rate: int) -> tuple[Any, int]:
    """The clip's samples, mono float32 at `rate` Hz, and its frame count as decoded. Raises
    AudioError as `decode_audio` does."""
    import miniaudio
    import numpy as np

    try:
        decoded = miniaudio.decode(
            data,
            output_format=miniaudio.SampleFormat.FLOAT32,
            nchannels=info.nchannels,
            sample_rate=info.sample_rate,
        )
    except Exception as exc:  # noqa: BLE001
        log.info("audio_undecodable", where=where, error=f"{type(exc).__name__}: {exc}")
        raise AudioError(
            f"{where} is a {fmt} file whose samples cannot be decoded (corrupt or cut short): "
            "send the whole clip",
            param=where,
        ) from None
    samples = np.asarray(decoded.samples, dtype=np.float32)
    if decoded.nchannels > 1:  # mono, as mlx-vlm's load_audio makes it: the channels' mean
        samples = samples.reshape(-1, decoded.nchannels).mean(axis=1)
    if samples.size == 0:
        raise AudioError(f"{where} is a {fmt} file with no samples: send a clip", param=where)
    if info.sample_rate != rate:  # mlx-vlm's resampler (a Kaiser-windowed sinc), so the
        from mlx_audio.utils import resample_audio  # model hears what mlx-vlm feeds it

        samples = np.asarray(resample_audio(samples, info.sample_rate, rate), dtype=np.float32)
    return samples, decoded.num_frames
