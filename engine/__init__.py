"""The MLX side of stepline: model loading, the batched caches, a step's forward passes
(`runner`), sampling, grammars, the prefix cache's arrays and files, images and
vision-language models. Code here runs on the executor's thread.

May import `stepline.actors.scheduler` (plans and results) and `stepline.events`; never
`stepline.api`. Importing this package loads nothing; it only arranges that OpenBLAS
(Linux) is loaded the moment anything first imports MLX (see `engine/_blas.py`), so a
program that never runs a model never loads it.
"""

from stepline.engine._blas import install_preload_hook

install_preload_hook()
