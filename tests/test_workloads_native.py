"""The native writers give what the plain form gives: the simulator's prompts
(``router_sim/sim/_prefetch.c``'s ``expand_array``, the per-token formula as tests/_reference.py
writes it), and the index's match details (``router_sim/router/_match.c``) set through their
slots the details their class makes. The simulator's answers (``Request.output_tokens``) are
checked against their formula."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_sim.router import _match
from router_sim.sim import native
from router_sim.sim.workloads import Request


def _zeros(n: int) -> array[int]:
    return array("i", [0]) * n


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([1, 3, 16, 512]),
    st.lists(st.integers(0, 2**40), min_size=1, max_size=6),
    st.data(),
)
def test_expand_array_is_the_per_token_formula(n: int, ids: list[int], data: st.DataObject) -> None:
    count = data.draw(st.integers(0, n * len(ids)))
    shift, mask = 22, 2**22 - 1
    out = native.expand_array(_zeros(count), tuple(ids), count, n, shift, mask)
    assert type(out) is array and out.typecode == "i"
    naive = [j << shift | (h & mask) for h in ids for j in range(n)][:count]
    assert out.tolist() == naive


def test_expand_array_refuses_what_it_cannot_expand() -> None:
    with pytest.raises(ValueError):
        native.expand_array(_zeros(1025), (1, 2), 1025, 512, 22, 2**22 - 1)
    with pytest.raises(TypeError):
        native.expand_array(_zeros(8), (1, "2"), 8, 4, 22, 2**22 - 1)
    with pytest.raises(TypeError):
        native.expand_array(_zeros(1), [1], 1, 4, 22, 2**22 - 1)


def test_the_writer_fills_only_an_int32_array_of_the_count() -> None:
    for out in (_zeros(3), _zeros(5), array("l", [0] * 4), bytearray(16), b"\0" * 16):
        with pytest.raises((ValueError, TypeError, BufferError)):
            native.expand_array(out, (1,), 4, 4, 22, 2**22 - 1)
    out = _zeros(4)
    assert native.expand_array(out, (5,), 4, 4, 22, 2**22 - 1) is out
    assert out.tolist() == [5, 1 << 22 | 5, 2 << 22 | 5, 3 << 22 | 5]


def test_the_prompt_formula_is_written_once_in_c() -> None:
    """The router's extension writes no prompts (the simulator's extension, whose prompt
    thread expands the same formula, does) and no answers (numpy writes their ids)."""
    assert not hasattr(_match, "id_run")
    assert not hasattr(_match, "expand_array")
    assert native.expand_array.__module__ == "router_sim.sim._prefetch"


def _answer_base(rid: int, length: int) -> int:
    """The first id of a generated answer: 2**30 plus the request id times 4099, modulo the
    ids left above 2**30 for a run of ``length``."""
    return 2**30 + (rid * 4099) % (2**30 - length)


@pytest.mark.parametrize("rid, length", [(0, 1), (7, 90), (123456, 4000), (2**40, 17)])
def test_answers_are_a_run_of_ids_above_the_prompts(rid: int, length: int) -> None:
    out = Request(rid, 0.0, 10, length, hash_ids=(1,)).output_tokens()
    assert type(out) is array and out.typecode == "i"
    base = _answer_base(rid, length)
    assert out.tolist() == list(range(base, base + length))
    assert min(out) >= 2**30
    assert Request(rid, 5.0, 3, length, hash_ids=(2,)).output_tokens() == out  # the id's run


def test_the_highest_answer_run_ends_below_2_to_the_31() -> None:
    for length in (1, 2, 400):
        # the request id whose run starts as high as the formula allows: 4099 * rid is
        # -1 modulo 2**30 - length, so the last id is 2**31 - 2
        m = 2**30 - length
        rid = (m - 1) * pow(4099, -1, m) % m
        out = Request(rid, 0.0, 10, length, hash_ids=(1,)).output_tokens()
        assert out.tolist() == list(range(2**31 - 1 - length, 2**31 - 1))


def test_match_details_made_through_their_slots_are_plain_match_details() -> None:
    import dataclasses

    from router_sim.router.indexer import _MATCH_DETAIL_FIELDS, MatchDetail

    table = _match.MaskTable()
    table.set_bit([11, 12, 13], 0)
    table.set_bit([11, 12], 1)
    by_call = table.detailed([11, 12, 13], {0: 5, 1: 9}, MatchDetail)
    by_slots = table.detailed([11, 12, 13], {0: 5, 1: 9}, MatchDetail, _MATCH_DETAIL_FIELDS)
    assert by_call == by_slots == {9: MatchDetail(2, 0, 0, 2), 5: MatchDetail(3, 0, 0, 3)}
    assert list(by_call) == list(by_slots)
    for detail in by_slots.values():
        assert type(detail) is MatchDetail
        assert hash(detail) == hash(MatchDetail(*dataclasses.astuple(detail)))
        with pytest.raises(dataclasses.FrozenInstanceError):
            detail.matched_blocks = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        table.detailed([11], {0: 5, 1: 9}, MatchDetail, (1, 2, 3, 4))
    with pytest.raises(TypeError):
        table.detailed([11], {0: 5, 1: 9}, MatchDetail, _MATCH_DETAIL_FIELDS[:3])
