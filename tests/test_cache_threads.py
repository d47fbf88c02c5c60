"""Misuse of the cache manager: a second thread is refused loudly (WrongThreadError, nothing
changed), prompts must be sequences of ints, and configs take no coerced values."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_helpers import manager, run
from pydantic import ValidationError

from kvcache import KVCacheManagerConfig, WrongThreadError
from kvcache.tokens import token_array

pytestmark = pytest.mark.timeout(30)


def _in_thread(call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` in another thread; the exception it raised (None if it returned)."""
    caught: list[BaseException] = []

    def body() -> None:
        try:
            call()
        except BaseException as exc:  # handed back to the test thread
            caught.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert not t.is_alive()
    return caught[0] if caught else None


def test_a_second_thread_is_refused_and_changes_nothing() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3, 4, 5])
    seq = m.create_kv_cache([1, 2, 3, 4, 9])
    events_before = list(sink.records)
    pages_before = m.num_available_pages()
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("create_kv_cache", lambda: m.create_kv_cache([1, 2, 3])),
        ("probe_reuse", lambda: m.probe_reuse([1, 2, 3])),
        ("clear_reusable_blocks", m.clear_reusable_blocks),
        ("iter_blocks", lambda: list(m.iter_blocks())),
        ("verify", m.verify),
        ("commit", lambda: seq.commit([7, 7])),
        ("resize", lambda: seq.resize(16)),
        ("suspend", seq.suspend),
        ("page_indices", seq.page_indices),
        ("stop_committing", seq.stop_committing),
        ("close", seq.close),
    ]
    for name, call in calls:
        error = _in_thread(call)
        assert isinstance(error, WrongThreadError), (name, error)
        assert name in str(error) and "belongs to thread" in str(error)
    # nothing moved: the owner goes on as if the intruder had never called
    assert list(sink.records) == events_before
    assert m.num_available_pages() == pages_before and not seq.closed
    # counters may be read from anywhere (metrics exporters)
    assert _in_thread(lambda: (m.kv_usage(), m.num_available_pages(), m.stats)) is None
    seq.commit([6])
    seq.close()
    m.verify()


def test_hand_over_passes_the_manager_to_the_next_thread() -> None:
    m, _ = manager(2, 8)
    run(m, [1, 2, 3])
    m.hand_over()
    assert _in_thread(lambda: run(m, [1, 2, 3, 4])) is None  # the worker thread owns it now
    with pytest.raises(WrongThreadError):
        m.create_kv_cache([1])  # the test thread gave it away


def test_first_user_owns_a_manager_built_elsewhere() -> None:
    m, _ = manager(2, 8)  # built in this thread, never used here
    assert _in_thread(lambda: run(m, [1, 2, 3])) is None
    with pytest.raises(WrongThreadError):
        m.probe_reuse([1, 2])


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, True, 3], "bool"),
        ([False], "bool"),
        ((0, 1, True), "bool"),
        ({1: 2, 3: 4}, "dict"),
        ({1, 2, 3}, "set"),
        (frozenset({1, 2}), "frozenset"),
        ({1: 2}.keys(), "dict_keys"),
    ],
)
def test_prompts_are_sequences_of_ints(tokens: Any, match: str) -> None:
    m, _ = manager(2, 8)
    with pytest.raises(TypeError, match=match):
        m.create_kv_cache(tokens)
    with pytest.raises(TypeError, match=match):
        token_array(tokens)
    seq = m.create_kv_cache([1, 2])
    with pytest.raises(TypeError, match=match):
        seq.commit(tokens)
    assert seq.num_tokens == 0 and m.stats.queries == 1
    seq.close()
    m.verify()


def test_ints_in_any_sequence_or_iterator_still_pack() -> None:
    assert token_array(iter([0, 1, 2])).tolist() == [0, 1, 2]
    assert token_array(range(3)).tolist() == [0, 1, 2]
    assert token_array((1, 0)).tolist() == [1, 0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tokens_per_block", "16"),
        ("tokens_per_block", 16.0),
        ("tokens_per_block", True),
        ("enable_partial_reuse", 1),
        ("enable_partial_reuse", "yes"),
        ("max_partial_scan", 3.0),
        ("tiers", [{"name": "device", "num_blocks": "8"}]),
        ("tiers", [{"name": 7, "num_blocks": 8}]),
        ("kv_layout", {"num_layers": "2", "num_kv_heads": 2, "head_dim": 8}),
    ],
)
def test_configs_take_no_coerced_values(field: str, value: Any) -> None:
    base: dict[str, Any] = {"tokens_per_block": 4, "tiers": [{"name": "device", "num_blocks": 4}]}
    with pytest.raises(ValidationError):
        KVCacheManagerConfig(**{**base, field: value})
    KVCacheManagerConfig(**base)  # the same config with proper types is fine


# token ids whose low byte is 0 or 1 (where a bool hides after packing) and others around them
_ids = st.sampled_from([0, 1, 2, 255, 256, 257, 65536, 65537, 2**24, 2**24 + 1, 2**31 - 1])


@given(st.lists(_ids, min_size=1, max_size=40), st.data())
def test_a_bool_anywhere_in_a_prompt_is_refused(tokens: list[int], data: Any) -> None:
    assert list(token_array(tokens)) == tokens
    at = data.draw(st.integers(0, len(tokens) - 1))
    flag = data.draw(st.booleans())
    bad: list[Any] = [*tokens[:at], flag, *tokens[at + 1 :]]
    with pytest.raises(TypeError, match="bool"):
        token_array(bad)
