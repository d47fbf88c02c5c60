"""Type stub of kvcache.keys' optional native token packing (built from _tokens.c)."""

from array import array

def pack_nonneg(arr: array[int], /) -> bytes | None:
    """The ids of ``arr`` (an array('i')) as 4-byte little-endian bytes, or None when one is
    negative."""
