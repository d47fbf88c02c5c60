"""Type stub of kvcache.keys' optional native token packing (built from _tokens.c)."""

from array import array
from typing import Any

def pack_nonneg(arr: array[int], /) -> bytes | None:
    """The ids of ``arr`` (an array('i')) as 4-byte little-endian bytes, or None when one is
    negative."""

_Bytes = bytes | bytearray | memoryview

def chain_keys(
    parent_key: _Bytes, data: _Bytes, start: int, step: int, count: int, /
) -> list[bytes]:
    """The chained sha256 keys of ``count`` blocks of ``step`` bytes of ``data`` from
    ``start`` (present only where the CPU has SHA-NI)."""

def all_nonneg(arr: array[int], /) -> bool:
    """Whether no id of ``arr`` (an array('i')) is negative."""

def keys_ok(keys: list[Any] | tuple[Any, ...], size: int, /) -> bool:
    """Whether ``keys`` holds only bytes objects of ``size`` bytes."""

def hashes_ok(hashes: list[Any] | tuple[Any, ...], /) -> bool:
    """Whether ``hashes`` holds only ints in [0, 2**64)."""
