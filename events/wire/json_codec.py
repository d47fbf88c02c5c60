"""JSON codec for KV cache events in the TensorRT-LLM LLM API shape (WIRE.md section 6).

``to_json(event)`` gives a plain dict ready for ``json.dumps``; ``from_json(obj)`` reads one
back, checking every field and raising :class:`DecodeError` with the path of the first bad
value. One extension beyond the LLM API shape: a ``removed`` event whose ``Removed.cache_level``
is known carries it as ``"cache_level"`` (readers that do not know it ignore it).
``Stored.block_size`` does not travel in JSON; it decodes as None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache.scope import U64_LIMIT
from kvcache.tokens import TOKEN_LIMIT

_HEX64: Final = re.compile(r"[0-9a-f]{64}")


class DecodeError(ValueError):
    """A malformed event or payload. The message says which value was wrong and why."""


# --- value checks shared by the JSON and wire decoders ----------------------------------------


def _kind(value: object) -> str:
    return "nothing (missing or nil)" if value is None else type(value).__name__


def expect_int(value: object, where: str, lo: int = 0, hi: int = U64_LIMIT) -> int:
    """``value`` as an int in [lo, hi); bools are not ints here."""
    if type(value) is not int:
        raise DecodeError(f"{where}: expected an int, got {_kind(value)}")
    if not lo <= value < hi:
        raise DecodeError(f"{where}: {value} is outside [{lo}, {hi})")
    return value


def expect_optional_int(value: object, where: str, lo: int = 0, hi: int = U64_LIMIT) -> int | None:
    return None if value is None else expect_int(value, where, lo, hi)


def expect_str(value: object, where: str) -> str:
    if type(value) is not str:
        raise DecodeError(f"{where}: expected a string, got {_kind(value)}")
    return value


def expect_list(value: object, where: str) -> list[Any]:
    if type(value) is not list:
        raise DecodeError(f"{where}: expected an array, got {_kind(value)}")
    return value


def expect_map(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DecodeError(f"{where}: expected an object, got {_kind(value)}")
    return value


def json_hash(value: object, where: str) -> BlockHash:
    """A JSON block hash: an unsigned 64-bit int, or 64 lowercase hex characters (v2_sha256)."""
    if type(value) is str:
        if _HEX64.fullmatch(value) is None:
            raise DecodeError(f"{where}: a string hash must be 64 lowercase hex characters")
        return value
    return expect_int(value, where)


# --- encode -----------------------------------------------------------------------------------


def _diff_json(diff: EventDiff | None) -> dict[str, Any] | None:
    if diff is None:
        return None
    return {"type": "event_diff", "old_value": diff.old_value, "new_value": diff.new_value}


def _stored_block_json(block: StoredBlock) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": block.block_hash,
        "tokens": [
            {"type": "unique_token", "token_id": tok, "token_extra_id": 0} for tok in block.tokens
        ],
        "lora_id": block.lora_id,
        "cache_level": block.cache_level,
        "priority": block.priority,
        "cache_salt_id": block.cache_salt_id,
    }


def _data_json(data: EventData) -> dict[str, Any]:
    if isinstance(data, Stored):
        return {
            "type": "stored",
            "parent_hash": data.parent_hash,
            "blocks": [_stored_block_json(b) for b in data.blocks],
        }
    if isinstance(data, Removed):
        out: dict[str, Any] = {"type": "removed", "block_hashes": list(data.block_hashes)}
        if data.cache_level is not None:
            out["cache_level"] = data.cache_level
        return out
    if isinstance(data, Updated):
        return {
            "type": "updated",
            "block_hash": data.block_hash,
            "cache_level": _diff_json(data.cache_level),
            "priority": _diff_json(data.priority),
        }
    if isinstance(data, Created):
        return {
            "type": "created",
            "num_blocks_per_cache_level": list(data.num_blocks_per_cache_level),
        }
    if isinstance(data, AllBlocksCleared):
        return {"type": "all_blocks_cleared"}
    raise TypeError(f"not an event payload: {type(data).__name__}")


def to_json(event: KVCacheEvent) -> dict[str, Any]:
    """The LLM API JSON object of ``event`` (a dict of plain JSON values)."""
    out: dict[str, Any] = {
        "event_id": event.event_id,
        "data": _data_json(event.data),
        "window_size": event.window_size,
        "hash_algo": event.hash_algo,
    }
    if event.attention_dp_rank is not None:
        out["attention_dp_rank"] = event.attention_dp_rank
    return out


# --- decode -----------------------------------------------------------------------------------


def _diff_from_json(value: object, where: str) -> EventDiff | None:
    if value is None:
        return None
    obj = expect_map(value, where)
    return EventDiff(
        old_value=expect_int(obj.get("old_value"), f"{where}.old_value"),
        new_value=expect_int(obj.get("new_value"), f"{where}.new_value"),
    )


def _token_from_json(value: object, where: str) -> int:
    if type(value) is int:  # a bare id is accepted as well as the unique_token object
        return expect_int(value, where, hi=TOKEN_LIMIT)
    obj = expect_map(value, where)
    extra = obj.get("token_extra_id", 0)
    if extra not in (0, None):
        raise DecodeError(
            f"{where}.token_extra_id: {extra!r} is not supported (only plain text tokens, "
            "token_extra_id 0, can be hashed)"
        )
    return expect_int(obj.get("token_id"), f"{where}.token_id", hi=TOKEN_LIMIT)


def _stored_block_from_json(value: object, where: str) -> StoredBlock:
    obj = expect_map(value, where)
    tokens = expect_list(obj.get("tokens"), f"{where}.tokens")
    return StoredBlock(
        block_hash=json_hash(obj.get("block_hash"), f"{where}.block_hash"),
        tokens=[_token_from_json(t, f"{where}.tokens[{i}]") for i, t in enumerate(tokens)],
        lora_id=expect_optional_int(obj.get("lora_id"), f"{where}.lora_id"),
        cache_level=expect_int(obj.get("cache_level", 0), f"{where}.cache_level"),
        priority=expect_int(obj.get("priority", 35), f"{where}.priority", hi=101),
        cache_salt_id=expect_optional_int(obj.get("cache_salt_id"), f"{where}.cache_salt_id"),
    )


def _data_from_json(value: object, where: str) -> EventData:
    obj = expect_map(value, where)
    kind = expect_str(obj.get("type"), f"{where}.type")
    if kind == "stored":
        parent = obj.get("parent_hash")
        blocks = expect_list(obj.get("blocks"), f"{where}.blocks")
        return Stored(
            parent_hash=None if parent is None else json_hash(parent, f"{where}.parent_hash"),
            blocks=[
                _stored_block_from_json(b, f"{where}.blocks[{i}]") for i, b in enumerate(blocks)
            ],
        )
    if kind == "removed":
        hashes = expect_list(obj.get("block_hashes"), f"{where}.block_hashes")
        return Removed(
            block_hashes=[json_hash(h, f"{where}.block_hashes[{i}]") for i, h in enumerate(hashes)],
            cache_level=expect_optional_int(obj.get("cache_level"), f"{where}.cache_level"),
        )
    if kind == "updated":
        return Updated(
            block_hash=json_hash(obj.get("block_hash"), f"{where}.block_hash"),
            cache_level=_diff_from_json(obj.get("cache_level"), f"{where}.cache_level"),
            priority=_diff_from_json(obj.get("priority"), f"{where}.priority"),
        )
    if kind == "created":
        levels = expect_list(
            obj.get("num_blocks_per_cache_level"), f"{where}.num_blocks_per_cache_level"
        )
        return Created(
            [
                expect_int(n, f"{where}.num_blocks_per_cache_level[{i}]")
                for i, n in enumerate(levels)
            ]
        )
    if kind == "all_blocks_cleared":
        return AllBlocksCleared()
    raise DecodeError(
        f"{where}.type: unknown event type {kind!r}; expected created, stored, removed, "
        "updated or all_blocks_cleared"
    )


def from_json(obj: Mapping[str, Any]) -> KVCacheEvent:
    """The event of an LLM API JSON object (as ``json.loads`` gives it).

    Raises :class:`DecodeError` naming the first missing or ill-typed field.
    """
    top = expect_map(obj, "event")
    return KVCacheEvent(
        event_id=expect_int(top.get("event_id"), "event.event_id"),
        data=_data_from_json(top.get("data"), "event.data"),
        window_size=expect_int(top.get("window_size", 0), "event.window_size"),
        hash_algo=expect_str(top.get("hash_algo", "v1_block_key"), "event.hash_algo"),
        attention_dp_rank=expect_optional_int(
            top.get("attention_dp_rank"), "event.attention_dp_rank"
        ),
    )


__all__ = ["DecodeError", "from_json", "to_json"]
