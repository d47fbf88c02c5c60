"""Type stub of the native JSON prompt reader extension (built from _json_prompt.c)."""

from array import array
from typing import Any

def json_prompt_first(body: bytes, limit: int) -> tuple[array[int], int] | None:
    """When ``body`` is a JSON object whose first member is ``"prompt"`` with an array that
    :func:`tokens_from_json` reads, its ids and the offset just past the array; else None."""

def tokens_from_json(data: Any, limit: int) -> array[int] | None:
    """The token ids of one JSON array of 1 to ``limit`` ints in ``[0, 2**31)`` written plainly
    (no sign, fraction, exponent or leading zero) that is the whole of ``data`` (a buffer), as
    an ``array('i')``; None for anything else."""
