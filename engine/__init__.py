"""The MLX side of stepline: model loading, caches, forward passes, sampling, policy.

Importing this package loads nothing: the scheduling policy and the prefix index are
pure. It only arranges that OpenBLAS (Linux) is loaded the moment anything first
imports MLX (see `engine/_blas.py`), so a program that never runs a model never loads it.
"""

from stepline.engine._blas import install_preload_hook

install_preload_hook()
