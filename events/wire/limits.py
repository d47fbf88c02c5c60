"""What one wire payload may cost the decoder (:class:`DecodeLimits`), and when the typed
structs alone keep a payload within them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on what one payload may cost the decoder; anything beyond raises DecodeError.

    The payload size is checked before decoding, and no declared length beyond the bytes
    present is allocated, so memory stays proportional to ``max_payload_bytes``.
    """

    max_payload_bytes: int = 16 << 20
    max_events: int = 1 << 16
    max_tokens_per_event: int = 1 << 20
    max_blocks_per_event: int = 1 << 16
    max_str_len: int = 1 << 16
    max_bin_len: int = 1 << 16
    max_fields: int = 64
    #: nesting of arrays and maps, the envelope counting 1 (the format itself needs 4)
    max_depth: int = 8

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive int, got {value!r}")
        if self.max_depth < 4:
            raise ValueError(
                f"DecodeLimits.max_depth must be >= 4 (the format nests 4 deep), "
                f"got {self.max_depth}"
            )


DEFAULT_LIMITS: Final = DecodeLimits()

_loose: dict[DecodeLimits, bool] = {DEFAULT_LIMITS: True}


def at_least_default(limits: DecodeLimits) -> bool:
    """Whether every bound of ``limits`` is at least as loose as the default's (the strict
    structs, capped at the defaults, then keep whatever they accept within ``limits``)."""
    ok = _loose.get(limits)
    if ok is None:
        ok = all(getattr(limits, n) >= getattr(DEFAULT_LIMITS, n) for n in DecodeLimits.__slots__)
        if len(_loose) < 256:
            _loose[limits] = ok
    return ok
