"""The MLX side of stepline: model loading, caches, forward passes, sampling, policy.

Importing this package loads OpenBLAS (Linux) before anything imports MLX.
"""

from stepline.engine._blas import preload_openblas

preload_openblas()
