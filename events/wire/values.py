"""Value rules of the wire decoder that the Structs cannot state (``events.wire.decode``).

msgspec checks field types and ranges as it decodes an event into its Structs
(``events.wire.structs``); the rules here then turn the checked values into model objects,
whichever step of the decoder read them: hash normalization, vLLM's cache salt inside
``extra_keys``, and how a store's token ids are split into blocks (placeholders, masked
stores, short last blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from events.wire._records import stored_blocks
from events.wire.json_codec import DecodeError, expect_list
from events.wire.model import BlockHash, Stored
from kvcache.scope import U64_LIMIT

MAX_BIN_HASH: Final = 64


class LimitError(DecodeError):
    """A payload beyond :class:`~events.wire.decode.DecodeLimits`: the whole payload is
    refused (a sender that exceeds the bounds is not trusted with the rest of its batch)."""


def wire_hash(value: object, where: str) -> BlockHash:
    if type(value) is int:
        # msgpack ints lie in [-2**63, 2**64): a negative one is a signed sender's uint64.
        return value + U64_LIMIT if value < 0 else value
    if type(value) is bytes and 0 < len(value) <= MAX_BIN_HASH:
        # 32-byte sha256 (ours, vLLM's), 16-byte xxhash128 (vLLM): a bin hash of any such
        # length reads as its lowercase hex string
        return value.hex()
    raise DecodeError(
        f"{where}: a block hash must be an int or a bin of 1..{MAX_BIN_HASH} bytes, "
        f"got {type(value).__name__}"
        + (f" of {len(value)} bytes" if isinstance(value, bytes) else "")
    )


def wire_hashes(value: object, where: str, limit: int) -> list[BlockHash]:
    items = expect_list(value, where)
    if len(items) > limit:
        raise LimitError(f"{where}: {len(items)} hashes exceed the limit of {limit}")
    if items and set(map(type, items)) == {int}:
        if min(items) >= 0:
            return items
        return [h + U64_LIMIT if h < 0 else h for h in items]
    return [wire_hash(h, f"{where}[{i}]") for i, h in enumerate(items)]


def salt_from_extra_keys(value: object, lora_name: str | None, where: str) -> str | None:
    """vLLM's cache salt: a bare string in the first block's ``extra_keys`` entry (the LoRA
    name, also a bare string there, comes first; multimodal keys are tuples, prompt-embeds
    digests bytes). None when the store does not start a salted sequence."""
    if value is None:
        return None
    keys = expect_list(value, where)
    first = keys[0] if keys else None
    if first is None:
        return None
    strings = [k for k in expect_list(first, f"{where}[0]") if type(k) is str]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[-1] if strings else None


def build_stored(
    hashes: list[BlockHash],
    tokens: Sequence[Any],
    block_size: int,
    parent_hash: BlockHash | None,
    values: tuple[int | None, int, int | None, int, str | None, int | None, str | None],
    where: str,
) -> Stored | None:
    """The Stored event of checked values; None for an empty store (it changes nothing).

    ``values``: (lora_id, cache_level, cache_salt_id, priority, lora_name, group, salt).
    ``tokens``: a list (each block gets a list slice) or a packed ``array('i')`` (each block
    gets an array slice). Raises DecodeError when the token count does not fit the hashes and
    ``block_size``."""
    lora_id, level, salt_id, priority, lora_name, group, salt = values
    n, count = len(hashes), len(tokens)
    if n == 0 and count == 0:
        return None
    masked = False
    if count == 0 and n:
        # A placeholder (vLLM's CPU offload: no token ids, block_size 0, or 16 on 0.11): the
        # blocks are named by hash only.
        tokens_per_block = max(block_size, 1)
    elif block_size == 0:
        raise DecodeError(f"{where}.block_size: 0 is outside [1, 2**31) for a store with tokens")
    elif (n - 1) * block_size < count <= n * block_size:
        tokens_per_block = block_size
    elif n and count > n * block_size and count % block_size == 0:
        # Sliding-window / Mamba stores: token_ids cover masked-out blocks that the hash
        # list leaves out, and the wire does not say which: the blocks' tokens are unknown.
        masked, tokens, tokens_per_block = True, [], block_size
    else:
        raise DecodeError(
            f"{where}: {count} token_ids do not fit {n} blocks of block_size {block_size} "
            f"(expected {max(n - 1, 0) * block_size + 1}..{n * block_size}); the sender's "
            "block_size or token list is inconsistent"
        )
    blocks = stored_blocks(hashes, tokens, tokens_per_block, lora_id, level, priority, salt_id)
    return Stored(
        parent_hash=parent_hash,
        blocks=blocks,
        block_size=block_size,
        group=group,
        lora_name=lora_name,
        salt=salt,
        masked=masked,
    )
