"""What every demo checkpoint shares: the demo names that are not the text demos'
(engine/models.py builds those, engine/vision/demos.py the vision ones,
engine/audio_model.py the audio one, engine/omni.py the omni one), and the demo tokenizer: a
byte-level BPE trained on the built-in corpus, its special and markup tokens, its files and
its Qwen3-style ChatML chat template. Imports no MLX, and nothing of stepline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_DEMO = "stepline-demo-vision"  # engine/vision/demos.py builds it (the vision extra)
AUDIO_DEMO = "stepline-demo-audio"  # engine/audio_model.py builds it (the vision extra)
VISION_QWEN_DEMO = "stepline-demo-vision-qwen"  # a Qwen2.5-VL, built there too
VISION_DEMOS = (VISION_DEMO, VISION_QWEN_DEMO)
OMNI_DEMO = "stepline-demo-omni"  # a Qwen3-Omni thinker: engine/omni.py builds it

CORPUS_PATH = Path(__file__).with_name("demo_corpus.txt")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in the demo tokenizer
# Single tokens that are ordinary text to the decoder (not "special"), as in Qwen3: a
# reasoning parser and a tool parser see them in the output. Ids 3-8.
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# Qwen3-style ChatML: a `# Tools` system block when tools are given, assistant tool calls as
# <tool_call> JSON blocks (what mlx-lm's `json_tools` parser reads), `tool` messages as
# <tool_response> blocks in a user turn, reasoning in <think> tags, and an empty think block
# after the generation prompt when `enable_thinking` is false. Content may be a string or
# OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content %}{%- for part in content %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- set rest = messages %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- text(messages[0]['content']) + '\\n\\n' }}{%- set rest = messages[1:] %}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, in <tools></tools>:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object of its name and "
    'arguments in <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- text(message['content']) }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def train_tokenizer_json(vocab_size: int) -> str:
    """Train the demo byte-level BPE on the built-in corpus; deterministic for one corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level with no normalizer: any unicode string encodes and decodes back exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *MARKUP_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    paragraphs = CORPUS_PATH.read_text(encoding="utf-8").split("\n\n")
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    data = json.loads(tokenizer.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return json.dumps(data, indent=2)


def tokenizer_files(max_context: int) -> dict[str, Any]:
    """The demo tokenizer's other files (name -> JSON content), for a context of `max_context`
    tokens: its config with the chat template, and its special tokens' map."""
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for i, token in enumerate((*SPECIAL_TOKENS, *MARKUP_TOKENS))
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        # Off, or decode() would rewrite " ." to "." and text would not round-trip.
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_max_length": max_context,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_tokens_map,
    }


def sentence_transformers_files(pooling: str, dimension: int) -> dict[str, Any]:
    """The files that make a checkpoint a sentence-transformers embedding model (path ->
    JSON content): its modules (the transformer, `pooling` over its hidden states of width
    `dimension`, then normalised to unit length) and the pooling's config."""
    modes = {"last": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}
    pooling_config: dict[str, Any] = {"word_embedding_dimension": dimension}
    for mode in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken"):
        pooling_config[f"pooling_mode_{mode}"] = mode == modes[pooling]
    pooling_config["include_prompt"] = True
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    return {
        "modules.json": modules,
        "1_Pooling/config.json": pooling_config,
        "2_Normalize/config.json": {},  # sentence-transformers writes none; a folder needs a file
        "config_sentence_transformers.json": {"prompts": {}, "similarity_fn_name": "cosine"},
    }


def multimodal_demo_path(
    name: str, version: int, shape: dict[str, Any], build: Any, cache_dir: str | Path | None
) -> Path:
    """The directory of the multimodal demo `name` (mlx-vlm's: the vision, audio and omni
    demos), built there by `build(directory)` on first use, under a digest of its recipe
    (`version`, its `shape` and the shared corpus) so a changed recipe builds anew."""
    import hashlib

    from stepline.engine.cache_dirs import build_once, cache_root
    from stepline.engine.vision.load import require_mlx_vlm

    require_mlx_vlm()
    recipe = json.dumps(
        {"v": version, "demo": shape, "corpus": CORPUS_PATH.read_text()}, sort_keys=True
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    final = cache_root(cache_dir) / "models" / f"{name}-{digest}"
    build_once(final, build)
    return final
