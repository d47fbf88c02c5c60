"""Golden vectors of WIRE.md sections 1-2: scope bytes, cache salt ids and block keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcache import ReuseScope, block_key, blockchain_keys, cache_salt_id, root_key

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "scope_key_vectors.json").read_text()
)


def test_vectors_say_where_they_come_from() -> None:
    assert "WIRE.md" in VECTORS["source"]


@pytest.mark.parametrize("case", VECTORS["scope_bytes"], ids=lambda c: c["hex"])
def test_scope_bytes(case: dict[str, Any]) -> None:
    scope = ReuseScope(lora_id=case["lora_id"], salt=case["salt"])
    assert scope.to_bytes().hex() == case["hex"]


def test_presence_is_not_value() -> None:
    scopes = {ReuseScope(), ReuseScope(lora_id=0), ReuseScope(salt=0), ReuseScope(0, 0)}
    assert len(scopes) == 4
    assert len({root_key(s) for s in scopes}) == 4


@pytest.mark.parametrize("case", VECTORS["cache_salt_id"], ids=lambda c: c["cache_salt"])
def test_cache_salt_id(case: dict[str, Any]) -> None:
    assert cache_salt_id(case["cache_salt"]) == case["salt"]
    assert ReuseScope.for_request(cache_salt=case["cache_salt"]).salt == case["salt"]


def test_root_keys() -> None:
    keys = VECTORS["keys"]
    assert root_key(ReuseScope()).hex() == keys["root_default"]
    assert root_key(ReuseScope(7, 11)).hex() == keys["root_7_11"]


def test_default_chain_with_partial_last_block() -> None:
    keys = VECTORS["keys"]
    chain = keys["default_chain"]
    got = blockchain_keys(ReuseScope(), chain["tokens"], keys["tokens_per_block"])
    assert [k.hex() for k in got] == chain["keys"]
    # block by block, chained from the root
    parent: bytes = root_key(ReuseScope())
    for i, want in enumerate(chain["keys"]):
        parent = block_key(parent, chain["tokens"][4 * i : 4 * i + 4])
        assert parent.hex() == want


def test_scoped_block() -> None:
    keys = VECTORS["keys"]
    got = blockchain_keys(ReuseScope(7, 11), [0, 1, 2, 3], keys["tokens_per_block"])
    assert [k.hex() for k in got] == [keys["block_0123_under_7_11"]]


@pytest.mark.parametrize("bad", [-1, 2**31, 2**40])
def test_token_range(bad: int) -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        blockchain_keys(ReuseScope(), [1, bad], 4)


@pytest.mark.parametrize("bad", [True, 1.5, "x", -3])
def test_scope_values_rejected(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ReuseScope(lora_id=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ReuseScope(salt=-1)
    with pytest.raises(ValueError):
        ReuseScope(salt=2**64)
