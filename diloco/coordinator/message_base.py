"""The base of the coordinator's wire messages (``messages``, ``quorum_messages``): a typed
dataclass that ``encode``s to protobuf bytes and ``decode``s them with strict validation, and the
size limits of an encoded message."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from google.protobuf import message as pb_message

from .fields import MessageError
from .pbconvert import _fill, _parse, _pb_to_obj

MAX_REQUEST_BYTES = 64 * 1024  # every message but summaries
MAX_SUMMARY_BYTES = 1024 * 1024

M = TypeVar("M", bound="Message")


class Message:
    """Base of all wire messages: ``encode`` to protobuf bytes, ``decode`` with validation."""

    LIMIT: ClassVar[int] = MAX_REQUEST_BYTES  # bytes of the encoded message
    PB: ClassVar[type[pb_message.Message]]  # its protobuf message class

    @classmethod
    def from_obj(cls: type[M], obj: dict[str, Any]) -> M:
        """Validate the dict of fields (the message's JSON shape) and build the message."""
        raise NotImplementedError

    def to_obj(self) -> dict[str, Any]:
        """The dict of fields (the message's JSON shape, group ids as string keys)."""
        raise NotImplementedError

    @classmethod
    def from_pb(cls: type[M], msg: pb_message.Message) -> M:
        """Validate a protobuf message of type ``PB``; raises MessageError."""
        if msg.DESCRIPTOR.full_name != cls.PB.DESCRIPTOR.full_name:
            raise MessageError(f"{cls.__name__}: expected {cls.PB.DESCRIPTOR.full_name}, "
                               f"got {msg.DESCRIPTOR.full_name}")
        try:
            obj = _pb_to_obj(msg, "")
        except RecursionError:
            raise MessageError(f"{cls.__name__}: nested too deeply") from None
        return cls.from_obj(obj)

    def to_pb(self) -> pb_message.Message:
        """The protobuf message (not validated: ``encode`` is)."""
        msg = self.PB()
        try:
            _fill(msg, self.to_obj(), "")
        except MessageError as exc:
            raise MessageError(f"{type(self).__name__}: {exc}") from None
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise MessageError(f"{type(self).__name__}: cannot encode ({exc})") from None
        return msg

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        """Parse and validate ``data``; raises MessageError."""
        return cls.from_pb(_parse(cls.PB, data, cls.LIMIT, cls.__name__))

    def encode(self) -> bytes:
        """Serialize and check the result against the same rules the receiver applies."""
        data = self.to_pb().SerializeToString()
        type(self).decode(data)
        return data


