"""Plain Python references of what the C extensions compute, for the tests to check them against.

Each is written from the documented behaviour, independent of the native code (none of it calls
an extension): the V1 block hash from WIRE.md 3 (TensorRT-LLM's ``BlockKeyHasher``, as the
hash-drift diagnosis states it in plain Python), the token codecs from msgspec, the simulator's
prompt expansion from its per-token formula (``router_sim.sim.workloads.expand_hash_ids``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta

from events.tools.diagnosis import v1_variant
from events.wire.fast import MAX_TOKENS
from kvcache.scope import ReuseScope
from kvcache.tokens import TOKEN_LIMIT

# --- the V1 block hash (WIRE.md 3) -----------------------------------------------------------


def v1_block_hash(
    tokens: Sequence[int],
    parent_hash: int = 0,
    lora_id: int | None = None,
    salt_id: int | None = None,
) -> int:
    """The V1 hash of one block (no input checks: give ids in [0, 2**31)): the drift-free form
    of ``events.tools.diagnosis.v1_variant``, plain Python written from WIRE.md 3 (the one
    statement of its mixing steps outside the C loop and the golden-vector generator)."""
    return v1_variant(tokens, parent_hash, lora_id, salt_id)


def v1_chain(tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope) -> list[int]:
    """The V1 hashes of the full blocks of ``tokens`` under ``scope``."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        parent = v1_block_hash(
            tokens[start : start + tokens_per_block], parent, scope.lora_id, scope.salt
        )
        hashes.append(parent)
    return hashes


# --- token ids as msgpack (events.wire._wire's pack_tokens / tokens_from_msgpack) -------------

_ENCODER: Final = msgspec.msgpack.Encoder()
_TOKENS_DECODER: Final = msgspec.msgpack.Decoder(
    Annotated[list[Annotated[int, Meta(ge=0, lt=TOKEN_LIMIT)]], Meta(max_length=MAX_TOKENS)]
)


def pack_tokens(tokens: Any) -> bytes | None:
    """The msgpack array msgspec writes for the ints of an ``array('i')``; None for any other
    container."""
    return _ENCODER.encode(tokens.tolist()) if type(tokens) is array else None


def packed_tokens(data: msgspec.Raw | bytes) -> array[int] | None:
    """The token ids of ``data``, one msgpack array of at most ``MAX_TOKENS`` ints in
    ``[0, 2**31)``, as an ``array('i')``; None for anything else."""
    try:
        return array("i", _TOKENS_DECODER.decode(data))
    except (msgspec.MsgspecError, RecursionError):
        return None


# --- the simulator's prompts (router_sim.router._match's expand_array) -----------------------

_PROMPT_TOKEN_BITS: Final = 30  # router_sim.sim.workloads.PROMPT_TOKEN_BITS
_OR_TABLES: Final = [bytes(x | c for x in range(256)) for c in range(256)]
"""``_OR_TABLES[c]`` maps a byte ``x`` to ``x | c`` (for ``bytes.translate``)."""


def expand_hash_ids(hash_ids: tuple[int, ...], input_length: int, n: int) -> array[int]:
    """The prompt of ``hash_ids`` (``n`` tokens each) cut to ``input_length`` tokens: token
    ``j`` of id ``h`` is ``j << b | (h mod 2**b)``, ``b = 30 - max(1, bit_length(n - 1))``.

    Written by byte lanes, not per token: the id part and the position part of a token occupy
    disjoint bits, so each byte lane of the little-endian prompt (byte ``i`` of every token) is
    one block's position lane with the id's byte OR-ed in (``bytes.translate``)."""
    k = -(-input_length // n)
    if k > len(hash_ids):
        raise ValueError(f"input_length {input_length} needs more than {len(hash_ids)} hash ids")
    pos_bits = max(1, (n - 1).bit_length())
    shift = _PROMPT_TOKEN_BITS - pos_bits
    mask = (1 << shift) - 1
    ids = [h & mask for h in hash_ids[:k]]
    words = b"".join((j << shift).to_bytes(4, "little") for j in range(n))
    raw = bytearray(4 * n * k)
    for lane in range(4):
        pattern = words[lane::4]
        byte = 8 * lane
        if any(pattern):
            raw[lane::4] = b"".join(
                [pattern.translate(_OR_TABLES[(h >> byte) & 0xFF]) for h in ids]
            )
        else:  # this lane holds id bits only
            raw[lane::4] = b"".join([bytes(((h >> byte) & 0xFF,)) * n for h in ids])
    out: array[int] = array("i")
    out.frombytes(raw)
    if sys.byteorder == "big":
        out.byteswap()
    del out[input_length:]
    return out
