"""The reuse namespace of a cached prefix.

A LoRA adapter and a tenant's cache salt each get their own namespace: a prefix cached under
one ``ReuseScope`` is never reused, probed or announced under another. The scope enters the
block keys through the root key (``sha256(scope.to_bytes())``), so two scopes never share a
node of the radix tree.

Byte format (WIRE.md section 1): one mask byte (bit 0: lora_id present, bit 1: salt present),
then one 8-byte little-endian unsigned value per present field, lora_id first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import total_ordering
from typing import Final

U64_LIMIT: Final = 1 << 64
_LORA_BIT: Final = 0x01
_SALT_BIT: Final = 0x02


def _check_u64(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"ReuseScope.{name} must be an int in [0, 2**64) or None, got "
            f"{type(value).__name__} {value!r}"
        )
    if not 0 <= value < U64_LIMIT:
        raise ValueError(f"ReuseScope.{name} must be in [0, 2**64), got {value}")


def cache_salt_id(cache_salt: str) -> int:
    """The 64-bit salt of a request's ``cache_salt`` string.

    ``int.from_bytes(sha256(cache_salt.encode("utf-8")).digest()[:8], "little")``.
    """
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    return int.from_bytes(hashlib.sha256(cache_salt.encode("utf-8")).digest()[:8], "little")


@total_ordering
@dataclass(frozen=True, slots=True)
class ReuseScope:
    """Who may reuse a cached prefix: a LoRA adapter id and a tenant salt, each optional.

    Presence is distinct from value: ``ReuseScope(lora_id=0)`` is neither ``ReuseScope()`` nor
    ``ReuseScope(salt=0)``.
    """

    lora_id: int | None = None
    salt: int | None = None
    _bytes: bytes = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_u64("lora_id", self.lora_id)
        _check_u64("salt", self.salt)
        mask = 0
        body = b""
        if self.lora_id is not None:
            mask |= _LORA_BIT
            body += self.lora_id.to_bytes(8, "little")
        if self.salt is not None:
            mask |= _SALT_BIT
            body += self.salt.to_bytes(8, "little")
        object.__setattr__(self, "_bytes", bytes([mask]) + body)

    @classmethod
    def for_request(cls, lora_id: int | None = None, cache_salt: str | None = None) -> ReuseScope:
        """The scope of a request that names a LoRA adapter and/or a cache salt string."""
        return cls(lora_id=lora_id, salt=None if cache_salt is None else cache_salt_id(cache_salt))

    def to_bytes(self) -> bytes:
        """The namespace serialization of WIRE.md section 1."""
        return self._bytes

    def _order_key(self) -> tuple[bool, int, bool, int]:
        return (
            self.lora_id is not None,
            self.lora_id or 0,
            self.salt is not None,
            self.salt or 0,
        )

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, ReuseScope):
            return NotImplemented
        return self._order_key() < other._order_key()


DEFAULT_SCOPE: Final = ReuseScope()
