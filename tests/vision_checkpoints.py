"""Tiny random-weight vision-language checkpoints in mlx-vlm's layout, built offline (no
download, no torch) for tests: config.json, model.safetensors, the tokenizer's and the
processor's files, as a converted Hugging Face checkpoint has them.

`tiny_gemma3(path)`: a Gemma 3 (model_type `gemma3`) with a 2-layer `gemma3_text` (one
sliding-window layer, one global) of hidden size 64 and a 1-layer SigLIP tower reading 64-pixel
images in 8-pixel patches, pooled to 16 soft tokens an image. Its tokenizer is the text demo's
byte-level BPE with Gemma 3's own markup added (`<bos>`, `<start_of_turn>`, `<end_of_turn>`,
`<start_of_image>`, `<image_soft_token>`, `<end_of_image>`), and its chat template is Gemma
3's: a `<bos>` first, an image part rendered as `<start_of_image>`.
"""

from __future__ import annotations

import json
from pathlib import Path

# Gemma 3's markup, ids from the end of the trained vocabulary on. What a chat template writes
# (`<bos>`, the turn markers) and what the processor writes (the image markers) are special
# tokens, as in Gemma 3's tokenizer.
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
GEMMA3_TOKENS = (PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE)
# Gemma 3's vocabulary has one token for each run of newlines (and of spaces), which a
# tokenizer reading a whole text takes wherever such a run stands: added here as ordinary
# (not special) added tokens, runs of up to 8.
NEWLINE_RUNS = tuple("\n" * n for n in range(1, 9))

# Gemma 3's chat template (its tokenizer_config.json's, laid out here): the template writes the
# <bos> (the tokenizer must not add another), a system message is folded into the first user
# turn, text parts are trimmed, an image part is the begin-of-image marker.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

GEMMA3 = {
    "text": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "num_hidden_layers": 2,
        "sliding_window_pattern": 2,  # layer 0 sliding (RotatingKVCache), layer 1 global
        "sliding_window": 16,  # shorter than a prompt with an image: the window moves
        "rope_theta": 1_000_000.0,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    },
    "vision": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "patch_size": 8,
        "image_size": 64,  # 8x8 patches, average-pooled 2x2 into 4x4 = 16 soft tokens
        "layer_norm_eps": 1e-6,
    },
    "mm_tokens_per_image": 16,
    "seed": 2,
    "init_std": 0.02,  # larger: greedy decoding of the random model repeats one token
}


def tiny_gemma3(path: Path, *, pan_and_scan: bool = False) -> Path:
    """Write the tiny Gemma 3 checkpoint into the directory `path` (created if missing) and
    return it. Deterministic: the same files every time. `pan_and_scan`: the processor also
    cuts an image wider or taller than 1.2:1 into up to 2 crops of at least 32 pixels, each
    encoded as an image of its own (Gemma 3's option, off in its own checkpoints)."""
    import mlx.core as mx
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from stepline.engine import demo_files as text_demo
    from stepline.engine.vision.demos import random_weights

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(text_demo.train_tokenizer_json(1024))
    tokenizer.add_special_tokens(list(GEMMA3_TOKENS))
    tokenizer.add_tokens([AddedToken(run, normalized=False) for run in NEWLINE_RUNS])
    ids = {t: tokenizer.token_to_id(t) for t in GEMMA3_TOKENS}
    # As Gemma 3's tokenizer: encoding with special tokens puts a <bos> first.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, ids[BOS])]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "unk_token": None,
                "boi_token": BOI,
                "eoi_token": EOI,
                "image_token": IMAGE,
                "extra_special_tokens": [START_OF_TURN, END_OF_TURN],
                "add_bos_token": True,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "split_special_tokens": False,
                "model_max_length": GEMMA3["text"]["max_position_embeddings"],
                "chat_template": GEMMA3_CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    side = GEMMA3["vision"]["image_size"]
    crops = (
        {
            "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": 32,
            "pan_and_scan_max_num_crops": 2,
            "pan_and_scan_min_ratio_to_activate": 1.2,
        }
        if pan_and_scan
        else {}
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}, **crops),
        tokenizer=hf_tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=GEMMA3["mm_tokens_per_image"],
    )
    processor.save_pretrained(str(path))

    vocab = len(hf_tokenizer)
    text = {
        **GEMMA3["text"],
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "mm_tokens_per_image": GEMMA3["mm_tokens_per_image"],  # where mlx-vlm reads it
    }
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(GEMMA3["vision"]),
        "mm_tokens_per_image": GEMMA3["mm_tokens_per_image"],  # where Hugging Face has it
        "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI],
        "image_token_index": ids[IMAGE],
        # mlx-vlm divides the image features by the square root of this (its default is
        # 2048), and the text model multiplies its input by that of the text hidden size.
        "hidden_size": text["hidden_size"],
        "pad_token_id": ids[PAD],
        "eos_token_id": [ids[EOS], ids[END_OF_TURN]],
        "vocab_size": vocab,
        "torch_dtype": "float32",
    }
    # Gemma's RMSNorm scales by 1 + weight; SigLIP's LayerNorm by weight.
    weights = random_weights(
        config,
        GEMMA3["seed"],
        GEMMA3["init_std"],
        norm=lambda name: 1.0 if name.startswith("vision_tower") else 0.0,
    )
    # An lm_head of its own (Gemma 3 ties it to the embeddings; mlx-vlm makes one either way,
    # which stepline's text model reads), so that the tokens a random model must not rank
    # first get a row of zeros (a logit of 0, where some other token's is above) and keep
    # their embeddings: the text demo's markup (not Gemma's) and every token added here, the
    # newline runs too (the byte-level detokenizers of mlx-vlm and mlx-lm cannot spell them;
    # Gemma 3's tokenizer is not byte-level).
    head = "language_model.lm_head.weight"
    demo_markup = len(text_demo.SPECIAL_TOKENS) + len(text_demo.MARKUP_TOKENS)
    reserved = mx.concatenate([mx.arange(demo_markup), mx.arange(ids[PAD], vocab)])
    weights[head] = weights[head].at[reserved].multiply(0.0)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


# A tiny Qwen3-VL: a 2-layer Qwen3 text model (interleaved M-RoPE sections 4/6/6), a 3-block
# vision tower of 8-pixel patches merged 2x2 whose blocks 0 and 1 feed the first two text
# layers (deepstack). Built as `stepline-demo-vision-qwen` is (`vision.build_qwen2_5_vl`).
QWEN3_VL = {
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "vision": {
        "model_type": "qwen3_vl",
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
        "in_channels": 3,
    },
    "min_pixels": 16 * 16,
    "max_pixels": 96 * 96,
    "seed": 7,
    "init_std": 0.08,
}


def tiny_qwen3_vl(path: Path) -> Path:
    """Write the tiny Qwen3-VL checkpoint into `path` (created if missing) and return it."""
    from stepline.engine.vision.qwen_vl import build_qwen2_5_vl

    path.mkdir(parents=True, exist_ok=True)
    build_qwen2_5_vl(path, QWEN3_VL)
    return path
