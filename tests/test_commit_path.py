"""The sequence's commit and admission path, as the simulator drives it: what a sequence
records and what the tree holds must not depend on how the work is shared out between the
manager, the sequence and the block pool (views instead of copies, chains keyed in one call)."""

from __future__ import annotations

import re
from array import array

from kv_helpers import manager, run, seen


def test_a_reused_prefix_is_the_sequence_s_own_even_before_it_is_read() -> None:
    """The reused prefix is kept as a view of the manager's packed prompt (no copy): changing
    the caller's array, committing, and only then reading ``tokens`` still gives what was
    reused and committed; so does reading it first and committing after."""
    m, _ = manager(4, 16)
    run(m, list(range(1, 13)), stop=True)  # three full blocks
    for tail, read_first in (([77, 78], False), ([88, 89], True)):
        prompt = array("i", [*range(1, 11), *tail])
        seq = m.create_kv_cache(prompt)
        assert seq.num_reused_tokens == 10  # [1..8] in full blocks, [9, 10] copy-on-write
        prompt[0] = prompt[9] = 99  # the caller's array, before anything read the prefix
        if read_first:
            assert seq.tokens == list(range(1, 11))
        seq.commit(array("i", tail))
        assert seq.tokens == [*range(1, 11), *tail]
        assert seq.num_tokens == 12
        seq.close()
    m.verify()


def test_everything_reused_is_recorded_without_a_commit() -> None:
    """A prompt whose whole reusable prefix is its length minus one: the view covers all of
    the packed prompt but the last token."""
    m, _ = manager(2, 16)
    run(m, [5, 6, 7, 8, 9], stop=True)
    seq = m.create_kv_cache([5, 6, 7, 8, 9])
    assert seq.num_reused_tokens == 4 and seq.tokens == [5, 6, 7, 8]
    seq.commit([9])
    assert seq.tokens == [5, 6, 7, 8, 9]
    seq.close()
    m.verify()


def test_a_long_chain_committed_at_once_joins_the_tree_in_order() -> None:
    """One commit of many full blocks below a node that already has children (the first key
    of the run comes from the match, the rest from one chain call): every block is found by
    a later request and announced once, in order."""
    m, sink = manager(2, 64)
    run(m, [1, 2, 3, 4])
    run(m, [1, 2, 5, 6])  # [1 2] now has two full children
    sink.clear()
    tokens = [1, 2, *range(100, 120)]
    seq = m.create_kv_cache(tokens)
    assert seq.num_reused_tokens == 2
    seq.commit(tokens[2:])
    seq.close()
    assert seen(sink) == [("stored", [[100 + i, 101 + i] for i in range(0, 20, 2)], [0] * 10)]
    assert m.probe_reuse([*tokens, 0]) == len(tokens)
    m.verify()


def test_commits_that_fill_a_block_across_calls_keep_their_own_tokens() -> None:
    """A commit that fills no block keeps its tokens as the block being filled (a copy: the
    caller's array changes afterwards); the commit that completes it is packed together with
    them, and the view of its own tokens records exactly what it added."""
    m, sink = manager(4, 16)
    seq = m.create_kv_cache([1, 2, 3])
    first = array("i", [1, 2])
    seq.commit(first)
    first[0] = 99
    second = array("i", [3, 4, 5, 6, 7, 8, 9])
    seq.commit(second)
    second[0] = 99
    assert seen(sink) == [("stored", [[1, 2, 3, 4], [5, 6, 7, 8]], [0, 0])]
    assert seq.tokens == list(range(1, 10)) and seq.num_tokens == 9
    seq.commit([10])
    assert seq.tokens == list(range(1, 11))
    seq.close()
    m.verify()


def test_a_bad_id_in_a_commit_after_a_partial_block_changes_nothing() -> None:
    """The new ids are checked together with the block being filled: a negative one, or a
    non-integer, is refused with the message of a first commit, and the sequence, its pages
    and the tree are as they were."""
    m, sink = manager(4, 16)
    seq = m.create_kv_cache([1, 2, 3])
    seq.commit([1, 2])
    pages = seq.page_indices()
    for bad, error, message in [
        ([3, -5, 4], ValueError, r"token ids must be in \[0, 2\*\*31\), got -5"),
        ([3, True], TypeError, "got bool"),
        ([3, "x"], TypeError, "token ids must be ints, got str"),
    ]:
        try:
            seq.commit(bad)  # type: ignore[arg-type]
        except error as exc:
            assert re.search(message, str(exc)), str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
        assert seq.num_tokens == 2 and seq.tokens == [1, 2] and seq.page_indices() == pages
    assert sink.records == [] and m.num_cached_blocks == 0
    seq.commit([3, 4])
    assert seen(sink) == [("stored", [[1, 2, 3, 4]], [0])]
    seq.close()
    m.verify()
