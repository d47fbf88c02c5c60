"""The sequence's commit and admission path, as the simulator drives it: what a sequence
records and what the tree holds must not depend on how the work is shared out between the
manager, the sequence and the block pool (views instead of copies, chains keyed in one call)."""

from __future__ import annotations

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
