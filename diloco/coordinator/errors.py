"""The one error type the coordinator package raises to its callers."""

from __future__ import annotations

#: trailing metadata of an error that says the job halted (members that disagree with no majority,
#: again): no restart mends it, so the caller stops with exit 2 instead of asking to be restarted
HALTED_TRAILER = "diloco-halted"


class CoordinatorError(RuntimeError):
    """A coordinator call failed: unreachable, rejected, timed out, or a bad reply.

    ``code`` is the gRPC status name the server answered with (``"INVALID_ARGUMENT"``,
    ``"FAILED_PRECONDITION"``, ``"DEADLINE_EXCEEDED"`` ...), or ``None`` when no call was made
    (the channel never became ready, or the request failed validation on this side). ``halted``:
    the coordinator said the job halted (the ``HALTED_TRAILER`` trailer): no restart mends it.
    """

    def __init__(self, message: str, code: str | None = None, *, halted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.halted = halted
