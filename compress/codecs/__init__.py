"""Codec families; importing this package registers them all."""
from . import block4, blockwise, floats, int2, sign, topk  # noqa: F401
