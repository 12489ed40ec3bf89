"""Audio in the same scheduler, on `stepline-demo-audio` (a random-weight Phi-4-multimodal; the
vision extra, which the test install brings): concurrent audio and text requests under small
and larger budgets answer exactly what mlx-vlm's own generation answers for each alone; a
clip's span is atomic (one chunk, never split, deferred or run alone), recorded in the log and
kept beside it; the next turn of a conversation does not encode its clip again.

mlx-vlm is the reference for what the model hears (its `load_audio` decoding of the file, its
Phi-4 feature extractor, Conformer and projection, its language model) on the same prompt ids:
its processor expands the audio token to as many copies as the clip has frames / 8, the id
hard-coded as Phi-4's own (200011), where the demo's small vocabulary holds it at 1024, so the
reference expands it as the processor does, by the config's id (`reference_ids`).
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import anyio
import numpy as np
import pytest
from helpers import collect

from stepline.api.engine import Engine
from stepline.api.params import SamplingParams
from stepline.engine.audio import AudioError, AudioLimits, decode_audio
from stepline.engine.models import AUDIO_DEMO
from stepline.events.log import read_events
from stepline.events.models import Admitted, ChunkPrefilled, ImageEncoded
from stepline.events.replay import verify

pytest.importorskip("mlx_vlm")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
RATE = 16_000


def wav(seconds: float, freq: float = 440.0, rate: int = RATE, channels: int = 1) -> bytes:
    """A WAV file of a sine tone (16-bit PCM), written with the standard library."""
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * np.sin(2 * np.pi * 3.1 * freq * t)
    pcm = np.repeat((tone * 32767).astype("<i2")[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def chat(text: str, clip: bytes | None = None) -> list[dict]:
    if clip is None:
        return [{"role": "user", "content": text}]
    parts = [{"type": "text", "text": text}, {"type": "audio", "audio": clip}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """mlx-vlm's own greedy generation of one chat on the demo, alone: its token ids."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_audio

    from stepline.engine.audio_model import AUDIO_TOKEN, demo_path

    model, processor = load(str(demo_path()))
    tokenizer = processor.tokenizer
    audio_id = model.config.audio_token_index
    extractor = processor.audio_processor
    where = tmp_path_factory.mktemp("clips")

    def run(messages: list[dict], max_tokens: int = 10) -> list[int]:
        clips = [p["audio"] for m in messages if isinstance(m["content"], list)
                 for p in m["content"] if p["type"] == "audio"]  # fmt: skip
        shown = [
            {**m, "content": [{"type": p["type"], "text": p.get("text")} for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        text = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text).input_ids
        kwargs = {}
        if clips:
            files = []
            for i, clip in enumerate(clips):
                (where / f"{i}.wav").write_bytes(clip)
                files.append((load_audio(str(where / f"{i}.wav"), sr=RATE), RATE))
            kwargs = extractor(files)
            sizes = iter(kwargs["audio_embed_sizes"].tolist())
            ids = [t for i in ids for t in ([i] * int(next(sizes)) if i == audio_id else [i])]
            assert AUDIO_TOKEN in text
        tokens = []
        for token, _ in generate_step(
            mx.array([ids]), model, None, None, max_tokens=max_tokens, temperature=0.0, **kwargs
        ):
            tokens.append(int(token))
        return tokens

    return run


async def greedy_chat(engine: Engine, messages: list[dict]) -> list:
    return await collect(engine.generate(messages=messages, params=GREEDY))


def token_ids(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("max_step_tokens", [32, 128])
async def test_concurrent_audio_and_text_requests_answer_what_mlx_vlm_answers_each_alone(
    reference, max_step_tokens: int, tmp_path: Path
) -> None:
    # 32: a 3 s clip's span (38 tokens) fits no step and runs alone; 128: spans fit, and are
    # deferred until a step holds them whole, beside text chunks and decode rows.
    chats = [
        chat("What is this sound?", wav(3.0)),
        chat("Describe it in one word.", wav(1.0, 880.0)),
        chat("Tell me about the sea and the sky, at length please."),
        chat("And this one, what is it?", wav(2.0, 220.0)),
    ]
    log = tmp_path / "events.jsonl"
    async with Engine.open(
        AUDIO_DEMO, max_step_tokens=max_step_tokens, max_num_seqs=8, event_log=str(log)
    ) as engine:
        results: list[list] = [[] for _ in chats]

        async def run(i: int) -> None:
            results[i] = await greedy_chat(engine, chats[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(chats)):
                tg.start_soon(run, i)
    for messages, outs in zip(chats, results, strict=True):
        assert outs[-1].finish_reason == "length"
        assert token_ids(outs) == reference(messages)
    assert verify(log).ok


async def test_the_log_records_each_clip_its_encoder_units_and_the_one_chunk_that_holds_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    clip = wav(2.0)
    async with Engine.open(
        AUDIO_DEMO, max_step_tokens=64, max_num_seqs=4, event_log=str(log), max_step_ms=None
    ) as engine:
        prepared = engine.prepare(messages=chat("What is this?", clip))
        outs = await greedy_chat(engine, chat("What is this?", clip))
    assert outs[-1].finish_reason == "length"
    events = list(read_events(log))
    (admitted,) = [e for e in events if isinstance(e, Admitted)]
    (ref,) = admitted.images
    (span,) = prepared.images
    assert ref.medium == "audio" and ref.whole
    assert (ref.start, ref.end) == (span.start, span.end) and ref.end - ref.start == 25
    assert ref.seconds == 2.0 and ref.num_samples == 32_000 and ref.units == 3
    assert ref.digest == span.digest and ref.width == ref.height == 0
    encoded = [e for e in events if isinstance(e, ImageEncoded)]
    assert sum(e.end - e.start for e in encoded) == 3
    chunks = [e for e in events if isinstance(e, ChunkPrefilled)]
    holding = [c for c in chunks if c.start < ref.end and ref.start < c.end]
    assert len(holding) == 1 and holding[0].start <= ref.start and ref.end <= holding[0].end
    # kept beside the log, by its digest, for re-execution
    assert (log.with_name(f"{log.name}.images") / ref.digest).read_bytes() == clip
    assert verify(log).ok


async def test_the_next_turn_with_a_clip_reuses_the_prefix_cache_and_does_not_encode_it_again(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    clip = wav(2.0)
    first = chat("What is this sound?", clip)
    async with Engine.open(AUDIO_DEMO, max_step_tokens=128, event_log=str(log)) as engine:
        outs = await greedy_chat(engine, first)
        answer = "".join(o.text for o in outs)
        second = [*first, {"role": "assistant", "content": answer}]
        second.append({"role": "user", "content": "Is it louder at the end?"})
        prepared = engine.prepare(messages=second)
        own = len(prepared.ids) - len(engine.prepare(messages=first).ids)  # the new turn's
        outs2 = await greedy_chat(engine, second)
    assert outs2[-1].finish_reason == "length"
    computed = len(prepared.ids) - outs2[-1].num_cached_tokens
    events = list(read_events(log))
    admitted = [e for e in events if isinstance(e, Admitted)]
    assert len(admitted) == 2
    second_id = admitted[1].request_id
    # the clip's span lies in the cached prefix: no encoder unit ran for the second request
    assert not [e for e in events if isinstance(e, ImageEncoded) and e.request_id == second_id]
    assert outs2[-1].num_cached_tokens > admitted[1].images[0].end
    assert computed <= own + 16  # the answer as the template shows it, the new question


def test_a_clip_is_decoded_to_mono_at_the_models_rate_from_wav_of_any_rate() -> None:
    stereo = decode_audio(wav(1.0, rate=44_100, channels=2), where="clip", rate=RATE)
    assert stereo.sample_rate == 44_100 and stereo.rate == RATE
    assert stereo.num_samples == RATE and stereo.samples.shape == (RATE,)
    assert stereo.seconds == 1.0 and stereo.format == "wav"
    low = decode_audio(wav(0.5, rate=8_000), where="clip", rate=RATE)
    assert low.num_samples == RATE // 2


@pytest.mark.parametrize("fmt", ["FLAC", "MP3"])
def test_flac_and_mp3_clips_decode_to_the_tone_they_hold(fmt: str) -> None:
    import soundfile

    written = 22_050 if fmt == "MP3" else RATE  # a second at the file's own rate
    t = np.arange(written) / written
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, tone, written, format=fmt)
    clip = decode_audio(out.getvalue(), where="clip", rate=RATE, claimed=fmt.lower())
    assert clip.format == fmt.lower()
    if fmt == "FLAC":  # lossless, at the model's rate: the samples as written (16-bit)
        assert clip.num_samples == RATE and np.abs(clip.samples - tone).max() < 1e-3
    else:  # 22.05 kHz resampled to 16 kHz; MP3's encoder delay and padding add a little
        assert abs(clip.seconds - 1.0) < 0.1 and clip.rate == RATE
        spectrum = np.abs(np.fft.rfft(clip.samples))
        assert abs(np.argmax(spectrum) * RATE / clip.num_samples - 440) < 5


def test_limits_and_bad_bytes_are_errors_naming_the_limit_and_the_part() -> None:
    cases = [
        (wav(3.0), AudioLimits(max_seconds=2.0), "audio_too_long", "max_audio_seconds"),
        (wav(1.0), AudioLimits(max_bytes=1000), "audio_too_large", "max_audio_bytes"),
        (
            wav(1.0, rate=48_000),
            AudioLimits(max_sample_rate=44_100),
            "audio_sample_rate_too_high",
            "max_audio_sample_rate",
        ),
        (b"not audio at all", AudioLimits(), "invalid_audio", "WAV, MP3 or FLAC"),
        (wav(1.0)[:30], AudioLimits(), "invalid_audio", "cannot be read"),
        (wav(1.0)[:44], AudioLimits(), "invalid_audio", "no samples"),
        (b"OggS" + bytes(60), AudioLimits(), "unsupported_audio_format", "an Ogg"),
    ]
    for data, limits, code, named in cases:
        with pytest.raises(AudioError) as caught:
            decode_audio(data, where="messages.0.content.1", rate=RATE, limits=limits)
        assert caught.value.code == code, caught.value.message
        assert named in caught.value.message
        assert caught.value.param == "messages.0.content.1"


def _audio_log(path: Path, chunks: list[tuple[int, int]], *, max_step_tokens: int = 8) -> Path:
    """A log of one 30-token prompt holding a clip's whole span [10, 22) (3 encoder units,
    all run in the first step), prefilled in `chunks`, one step each."""
    from log_builder import LogBuilder

    from stepline.events.models import ImageRef

    b = LogBuilder(max_step_tokens=max_step_tokens)
    b.admit("a", 30)
    clip = ImageRef(
        digest="d" * 64, start=10, end=22, num_bytes=100, width=0, height=0, units=3,
        medium="audio", seconds=1.0, num_samples=16_000,
    )  # fmt: skip
    b.events[-1] = b.events[-1].model_copy(update={"images": (clip,)})
    b.plan(("a", "encode", 0))
    b._add(ImageEncoded, request_id="a", image=0, start=0, end=3)
    for start, end in chunks:
        b.do_step(prefill={"a": (start, end)})
    return b.write(path)


def test_replay_verify_flags_a_clip_split_across_steps_and_passes_one_run_alone(
    tmp_path: Path,
) -> None:
    from stepline.events.replay import ViolationKind

    alone = verify(_audio_log(tmp_path / "alone.jsonl", [(0, 8), (8, 10), (10, 22), (22, 30)]))
    assert alone.ok  # 12 tokens past a budget of 8: the span alone, as no step could hold it
    split = verify(_audio_log(tmp_path / "split.jsonl", [(0, 8), (8, 16), (16, 24), (24, 30)]))
    kinds = {v.kind for v in split.violations}
    assert ViolationKind.CHUNK_SPLITS_IMAGE in kinds
    (flagged,) = [v for v in split.violations if v.kind is ViolationKind.CHUNK_SPLITS_IMAGE]
    assert "inside its audio clip's span [10, 22)" in flagged.message
    crowded = verify(
        _audio_log(tmp_path / "crowded.jsonl", [(0, 8), (8, 22), (22, 30)], max_step_tokens=8)
    )
    assert ViolationKind.STEP_OVER_BUDGET in {v.kind for v in crowded.violations}


async def test_a_run_with_audio_is_re_executed_token_for_token_from_the_clips_kept(
    tmp_path: Path,
) -> None:
    from stepline.api.reexecute import reexecute

    log = tmp_path / "events.jsonl"
    chats = [chat("What is this sound?", wav(1.5)), chat("Just text.")]
    async with Engine.open(AUDIO_DEMO, max_step_tokens=32, event_log=str(log)) as engine:
        async with anyio.create_task_group() as tg:
            for messages in chats:
                tg.start_soon(greedy_chat, engine, messages)
    report = await reexecute(log, AUDIO_DEMO)
    assert report.ok and report.num_compared == 2


def test_stepline_generate_asks_about_an_audio_file(tmp_path: Path, capsys) -> None:
    from stepline.api.cli import main

    clip = tmp_path / "tone.wav"
    clip.write_bytes(wav(1.0))
    argv = ["generate", "What is this?", "--audio", str(clip), "--model", AUDIO_DEMO]
    assert main([*argv, "--max-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert "output 6 tokens (length)" in out.err and out.out.strip()


def test_the_warm_up_of_an_audio_model_times_its_encoder_on_a_clip() -> None:
    # What the fit makes of the samples depends on the machine (the demo's encoder units are
    # so cheap that a busy one prices them at 0): the test asks only that they were timed.
    from stepline.actors.scheduler.plan import SchedulerConfig
    from stepline.actors.scheduler.warmup import Warmup
    from stepline.engine.models import load_model
    from stepline.engine.runner import ModelRunner

    loaded = load_model(AUDIO_DEMO)
    runner = ModelRunner(loaded)
    warmup = Warmup(runner, SchedulerConfig(max_step_tokens=128), 1000, loaded.max_context)
    warmup.run()
    assert warmup.done and not warmup.failed
    assert runner.num_sequences == 0  # it frees what it admitted
    encoded = [s for s in warmup.samples if s.features.audio_units]
    assert len(encoded) >= 2 and all(s.features.decode_rows >= 1 for s in encoded)
    assert all(s.seconds > 0 for s in encoded)


async def test_audio_to_a_model_without_an_audio_encoder_is_refused_before_decoding() -> None:
    async with Engine.open("stepline-demo") as engine:
        assert not engine.accepts_audio
        with pytest.raises(AudioError, match="no audio encoder") as err:
            await engine.submit(messages=chat("What is this?", b"not even audio"))
        assert err.value.code == "unsupported_content_type"


def test_a_clip_past_the_conformers_window_is_encoded_unit_by_unit_as_mlx_vlm_encodes_it():
    # 45 s: ~560 frames after subsampling, past the 500 the Conformer attends within, so it
    # is cut into pieces of 500 (padded) and folded back, as mlx-vlm's encoder does.
    import mlx.core as mx

    from stepline.engine.audio import decode_audio
    from stepline.engine.models import load_model
    from stepline.engine.vision.parts import EncodeJob

    parts = load_model(AUDIO_DEMO).vision
    clip = decode_audio(wav(45.0), where="clip", rate=RATE, limits=AudioLimits(max_seconds=60))
    expanded = parts.audio.expand(clip)
    n = expanded.text.count("<|endoftext11|>")
    assert n > 500
    job = EncodeJob(mx.zeros((n,), dtype=mx.int32), expanded.inputs, expanded.units)
    for u in range(expanded.units):
        parts.audio_encoder.run(job, u, u + 1)
    vlm = parts.audio_encoder.vlm
    features = mx.array(expanded.inputs["input_audio_embeds"])
    want = vlm.audio_projection(vlm.audio_encoder(features, None)[0], mode="speech")[:, :n]
    assert job.embeddings is not None and job.embeddings.shape == want.shape == (1, n, 64)
    assert mx.allclose(job.embeddings, want, atol=1e-5).item()
