"""Token arrays: a request's token ids checked once and packed as native int32s (``array('i')``),
and their 4-byte little-endian encoding, the bytes every block hash reads (``kvcache.hashing``).

Token ids are ints in [0, 2**31): no bools, floats or text; the checks raise ``TypeError`` /
``ValueError`` naming the first bad id.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Final

TOKEN_LIMIT: Final = 1 << 31
_BIG_ENDIAN: Final = sys.byteorder == "big"
_HIGH_BYTE: Final = 0 if _BIG_ENDIAN else 3  # offset of the sign-carrying byte of an int32
_LOW_BYTE: Final = 3 - _HIGH_BYTE


def token_array(tokens: Iterable[int]) -> array[int]:
    """Validate token ids and pack them as 32-bit ints (one pass, done once per request).

    Raises ``TypeError`` for non-integers (``True`` is not a token id) and for unordered or
    text input (a set, a mapping, a str), and ``ValueError`` for ids outside [0, 2**31).
    """
    return token_array_bytes(tokens)[0]


def token_array_bytes(tokens: Iterable[int]) -> tuple[array[int], bytes]:
    """:func:`token_array` and the tokens' 4-byte LE encoding (:func:`tokens_to_bytes`), from
    one packing: the check below reads the same bytes the block keys hash, so a request's
    tokens are copied out of the array once, not once to check and again to hash."""
    if isinstance(tokens, array) and tokens.typecode == "i":  # noqa: SIM108 (mypy narrows)
        arr = tokens
    else:
        arr = _from_ints(tokens)
    data = arr.tobytes()
    # Sign check on the raw bytes: a negative int32 is one whose high byte is 0x80 or more,
    # so the high bytes are all below 0x80 (``isascii``, a word-at-a-time C loop) exactly
    # when every id is non-negative; far cheaper than min() over Python ints on long prompts.
    if not data[_HIGH_BYTE::4].isascii():
        raise ValueError(f"token ids must be in [0, 2**31), got {min(arr)}")
    if _BIG_ENDIAN:
        data = tokens_to_bytes(arr)
    return arr, data


def checked_token_array(tokens: Iterable[int], checked: int = 0) -> array[int]:
    """:func:`token_array` without the packed bytes: the same checks and errors (the sign
    check of :func:`token_array_bytes`). ``checked``: how many leading ids a check already
    passed (the block keys made from them, see ``KVCacheManager.create_kv_cache``); their
    types are still checked, their sign not again."""
    arr = int32_array(tokens)
    data = memoryview(arr)[checked:].tobytes() if checked else arr.tobytes()
    if not data[_HIGH_BYTE::4].isascii():
        raise ValueError(f"token ids must be in [0, 2**31), got {min(arr[checked:])}")
    return arr


def int32_array(tokens: Iterable[int]) -> array[int]:
    """``tokens`` as an ``array('i')`` with their types checked (an ``array('i')`` as it is),
    their sign not yet: :func:`token_array_bytes` checks that, on this array or on one it is
    part of. Same errors as :func:`token_array` for non-integers and unordered input."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    return _from_ints(tokens)


def _from_ints(tokens: Iterable[int]) -> array[int]:
    if isinstance(tokens, (str, bytes, AbstractSet, Mapping)):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    if not isinstance(tokens, (list, tuple, array)):
        tokens = list(tokens)  # an iterator is read once, by the checks below and the packing
    try:
        arr = array("i", tokens)
    except OverflowError:
        bad = next(
            (t for t in tokens if isinstance(t, int) and not 0 <= t < TOKEN_LIMIT), "out of range"
        )
        raise ValueError(f"token ids must be in [0, 2**31), got {bad}") from None
    except TypeError:
        bad_t = next((t for t in tokens if not isinstance(t, int)), None)
        raise TypeError(f"token ids must be ints, got {type(bad_t).__name__} {bad_t!r}") from None
    if _holds_bool(tokens, arr):
        raise TypeError("token ids must be ints, got bool (True/False is not a token id)")
    return arr


def _holds_bool(tokens: Sequence[int], arr: array[int]) -> bool:
    """Whether a bool hides among ``tokens`` (they pack as 0 and 1). Only the tokens whose low
    byte is 0 or 1 are looked at, found by ``bytes.find`` (memchr) over the packed low bytes:
    about 2 in 256 tokens of a real prompt, so a long prompt costs a few microseconds, not a
    type check per token (``array.count`` or ``index`` would box every element)."""
    low = arr.tobytes()[_LOW_BYTE::4]
    for byte in (b"\x00", b"\x01"):
        at = low.find(byte)
        while at >= 0:
            if type(tokens[at]) is bool:
                return True
            at = low.find(byte, at + 1)
    return False


def tokens_to_bytes(tokens: array[int]) -> bytes:
    """Little-endian 4-byte encoding of an already validated token array."""
    if _BIG_ENDIAN:
        swapped = array("i", tokens)
        swapped.byteswap()
        return swapped.tobytes()
    return tokens.tobytes()


def pack_range(tokens: array[int], start: int, stop: int) -> bytes:
    """:func:`tokens_to_bytes` of ``tokens[start:stop]``, copied once (not sliced first)."""
    if _BIG_ENDIAN:
        return tokens_to_bytes(tokens[start:stop])
    return memoryview(tokens)[start:stop].tobytes()


def tokens_from_bytes(data: bytes) -> array[int]:
    """The token array of a :func:`tokens_to_bytes` encoding."""
    arr = array("i")
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr
