"""Error feedback: carry what a lossy codec dropped into the next call for the same shard."""
from __future__ import annotations

import torch

from .codec import Codec, Frame


class ErrorFeedback:
    """Wraps a codec for one shard (a fixed-length 1-D tensor) and keeps its residual.

    Each call encodes ``y = beta * residual + x`` and keeps ``residual = y - decoded``, so over
    any number of calls (with ``beta=1``) ``sum(decoded) + residual == sum(x)`` up to fp32
    rounding. ``beta < 1`` decays old error, as SparseLoCo does (beta = 0.95 there).
    """

    def __init__(self, codec: Codec, beta: float = 1.0) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"ErrorFeedback wraps a compress.Codec, got {type(codec).__name__}")
        if not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        self.codec = codec
        self.beta = float(beta)
        self.residual: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> Frame:
        """Encode ``x`` plus the carried residual; returns the frame."""
        return self.encode_with_decoded(x)[0]

    def encode_with_decoded(self, x: torch.Tensor) -> tuple[Frame, torch.Tensor]:
        """Encode ``x`` plus the carried residual; returns the frame and exactly what a peer
        decodes from it. The residual becomes what that decoded value is missing."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
            raise TypeError("ErrorFeedback encodes 1-D float32 tensors")
        r = self.residual
        if r is not None and (r.shape != x.shape or r.device != x.device):
            raise ValueError(f"this ErrorFeedback holds a residual of shape {tuple(r.shape)} on "
                             f"{r.device}; got {tuple(x.shape)} on {x.device} (one per shard; "
                             "call reset() to start over)")
        if r is None:
            y = x.clone()
        elif self.beta == 1.0:
            y = r + x
        else:
            y = torch.add(x, r, alpha=self.beta)
        frame, decoded = self.codec.encode_with_decoded(y)
        self.residual = y.sub_(decoded)
        return frame, decoded

    def decode(self, frame: bytes | bytearray | memoryview,
               device: torch.device | str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode a frame of the wrapped codec (receivers need no residual)."""
        return self.codec.decode(frame, device, out)

    def reset(self) -> None:
        """Forget the residual (e.g. when the shard's layout changes)."""
        self.residual = None

    @property
    def name(self) -> str:
        """Name of the wrapped codec."""
        return self.codec.name
