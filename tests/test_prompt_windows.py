"""A new request's prompt is checked whole but packed only as far as the manager matches it
(``RadixTree.match_prefix``: windows that grow fourfold while every block matches). Whatever
the windows, the reuse, the sequence's record of its tokens and the refusals must be those of a
prompt matched in one piece."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import manager, run

import kvcache.manager as manager_module
from kvcache.tokens import checked_token_array, token_array_bytes

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


def outcome(tokens: Any, fn: Any) -> Any:
    try:
        return ("ok", list(fn(tokens)))
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(INT32, max_size=200), as_array=st.booleans())
def test_the_check_alone_agrees_with_packing(tokens: list[int], as_array: bool) -> None:
    """checked_token_array accepts and refuses exactly what token_array_bytes does, with its
    messages."""
    given_tokens = array("i", tokens) if as_array else tokens
    want = outcome(given_tokens, lambda t: token_array_bytes(t)[0])
    assert outcome(given_tokens, checked_token_array) == want


@pytest.fixture(params=[1, 2, 8, 1024])
def window(request: pytest.FixtureRequest) -> Iterator[int]:
    """The first window, in tokens (1024 is the manager's own)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(manager_module, "_FIRST_WINDOW_TOKENS", request.param)
        yield request.param


@pytest.mark.usefixtures("window")
@settings(max_examples=60, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=60), max_size=4),
    prompt=st.lists(st.integers(0, 2), min_size=1, max_size=80),
    partial=st.booleans(),
)
def test_reuse_and_the_recorded_prefix_do_not_depend_on_the_windows(
    stored: list[list[int]], prompt: list[int], partial: bool
) -> None:
    """Against a naive model: the longest prefix (at most len - 1 tokens) of the prompt that
    some stored request's tokens start with, with full blocks only unless partial reuse is
    on; the sequence records exactly that prefix, then what it commits."""
    m, _ = manager(2, 256, partial=partial)
    for tokens in stored:
        run(m, tokens, stop=True)
    cap = len(prompt) - 1

    def shared(tokens: list[int]) -> int:
        n = 0
        while n < min(cap, len(tokens)) and tokens[n] == prompt[n]:
            n += 1
        return n

    best = max((shared(t) for t in stored), default=0)
    want = best if partial else best - best % 2
    assert m.probe_reuse(prompt) == want
    seq = m.create_kv_cache(array("i", prompt))
    assert seq.num_reused_tokens == want
    assert seq.tokens == prompt[:want]
    seq.commit(prompt[want:])
    assert seq.tokens == prompt
    seq.close()
    m.verify()
