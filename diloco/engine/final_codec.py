"""A codec for each fragment's last exchange in place of the averager's (``DiLoCo(final_codec=...)``,
``--final-codec``).

The last exchange is the one launched at the schedule's last step, or in the last time round;
every group switches at that launch, so all run it with the same codec. With an error-fed codec
before it, the residuals go out with that exchange (``set_error_feedback``), so the final model
holds what the groups computed and the 2-bit/1-bit codecs held back.
"""

from __future__ import annotations

from typing import Any

from diloco.engine.averaging import CodecSwitching
from diloco.engine.fragment import Fragment


class FinalCodec:
    """``codec`` for each fragment's last exchange of ``engine`` (a ``DiLoCo``); checked as it is
    made: it keeps no residual itself, the sync mode and outer rule allow one, the averager
    switches codecs (``set_codec``) and the schedule knows its end."""

    def __init__(self, engine: Any, codec: Any) -> None:
        self.engine, self.codec = engine, codec
        if getattr(codec, "requires_error_feedback", False):
            raise ValueError(f"the final codec {codec.name} keeps a residual itself: the last exchange would leave "
                             "one behind; use one without error feedback (fp32, bf16, int8, int4, ...)")
        if engine.tiles is not None:
            raise ValueError("SparseLoCo's outer rule needs error feedback to the end: no final codec with it")
        if not engine.sync.traits.final_codec:
            raise ValueError(f"mode {engine.mode!r} reconciles its last round exactly: no final codec with it")
        if not isinstance(engine.averager, CodecSwitching):
            raise ValueError(f"{type(engine.averager).__name__} cannot switch codecs: no final codec with it")
        if engine.time_rounds is None and getattr(engine.schedule, "total_steps", None) is None:
            raise ValueError("a final codec needs a schedule that knows its last step (total_steps)")

    def is_last_launch(self, frag: Fragment) -> bool:
        """Whether the fragment's launch now is its last of the job."""
        engine = self.engine
        if engine.time_rounds is not None:
            return frag.round + 1 >= engine.time_rounds.rounds
        total = getattr(engine.schedule, "total_steps", None)
        return total is not None and engine.inner_step >= total

    def before_launch(self, frag: Fragment) -> None:
        """At the fragment's last launch, switch the averager to the final codec (every group at
        the same launch: the same step or round), and the residuals to what it needs."""
        if not self.is_last_launch(frag):
            return
        averager = self.engine.averager
        if averager.codec is not self.codec:
            averager.set_codec(self.codec)
            self.engine.set_error_feedback(bool(getattr(self.codec, "requires_error_feedback", False)))
