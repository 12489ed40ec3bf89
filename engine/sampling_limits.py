"""The ranges sampling parameters must lie in, shared by the Python API and the sampler.

MLX-free, so the API validates with the same numbers the executor relies on.
"""

import math

# Below this temperature a row is sampled greedily (argmax): dividing logits by so small a
# number leaves one token with all the mass anyway, and greedy is exact and cheaper.
GREEDY_TEMPERATURE = 1e-5
# Largest top_k / token id MLX can hold in the int32 arrays the sampler builds.
MAX_INT32 = 2**31 - 1
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY]


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float (not a bool, not NaN or an infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
