"""Vision-language models through mlx-vlm (the `vision` extra), served by the text engine.

A vision-language model is a text model that reads, at an image's token span, the vision
encoder's output instead of its token embeddings. stepline loads the checkpoint with mlx-vlm
(its model classes, processor and vision encoder) and runs the text part as the mlx-lm model
of the same architecture, on the same weight arrays (`text_model.py`), so everything the
engine does for text models (batched decode, fused steps, CPU attention, the prefix cache)
holds for it unchanged. An image's encoder work is its own, in units a step runs some of
(`VisionEncoder.run`); its output, the span's embeddings, is kept with the request, and a
prompt chunk that holds image tokens is fed those embeddings instead of the tokens'.

The modules:
- `parts.py`: what every family shares: a medium's span as a prompt holds it (`Expanded`),
  its encoder work in progress (`EncodeJob`), the encoder's contract and the span
  embeddings of a prompt chunk (`VisionEncoder`), what a loaded model carries
  (`VisionParts`, `VisionCheckpoint`);
- one module per family, each with its prompt side (how an image becomes a span), its
  encoder's units and its demo, if it has one: `idefics3.py` (Idefics3 / SmolVLM: tiles, a
  layer of a tile a unit), `gemma3.py` (Gemma 3: the whole encoder one unit), `qwen_vl.py`
  (Qwen2.5-VL and Qwen3-VL: a block of the tower a unit, 3-D M-RoPE positions,
  `engine/mrope.py`; Qwen3-Omni's thinker, `engine/omni.py`, reads its images the same way);
- `text_model.py`: the mlx-lm text model on a checkpoint's own weight arrays;
- `load.py`: a checkpoint's family by its `model_type` (`FAMILIES`), and loading it; the
  audio families' (`engine/audio_model.py`) and the omni thinker's (`engine/omni.py`) too;
- `demos.py`: `stepline-demo-vision` (a random-weight Idefics3) and
  `stepline-demo-vision-qwen` (a random-weight Qwen2.5-VL), built on first use with the demo
  tokenizer, and the seeded random weights every mlx-vlm demo is made of.

May import the rest of `stepline.engine`; `engine/audio_model.py` and `engine/omni.py` build
on its parts. mlx-vlm is imported only in this package and those two modules, and they only
when a multimodal model is loaded. Importing this package imports nothing.
"""
