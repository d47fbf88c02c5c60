"""Kept for imports written before the codec moved: the codec is :mod:`events.wire.codec`."""

from events.wire.codec import (
    DEFAULT_LIMITS,
    DecodeError,
    DecodeLimits,
    decode_batch,
    encode_batch,
    from_json,
    to_json,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DecodeError",
    "DecodeLimits",
    "decode_batch",
    "encode_batch",
    "from_json",
    "to_json",
]
