"""The record of a run: the event models (`models`), the append-only log (`log`: writer,
reader, format, lock), the images kept beside it (`image_files`), the fold that turns
events into request state (`fold`, the same function live and in replay), the light structs
of bulk reads (`scan`); `replay` answers questions from a log alone.

MLX-free. May import nothing of stepline outside `stepline.events`.
"""
