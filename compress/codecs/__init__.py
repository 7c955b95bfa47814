"""Codec families; importing this package registers them all."""
from . import block4, blockwise, floats, sign, topk  # noqa: F401
