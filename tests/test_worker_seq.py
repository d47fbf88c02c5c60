"""A simulated request's token spans: the prompt and the answer kept apart read as one sequence."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from router_sim.sim.metrics import RequestRecord
from router_sim.sim.worker import _Seq
from router_sim.sim.workloads import Request


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12),
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12),
    st.data(),
)
def test_span_reads_prompt_then_answer(
    prompt: list[int], answer: list[int], data: st.DataObject
) -> None:
    req = Request(0, 0.0, len(prompt), len(answer), prompt=array("i", prompt))
    seq = _Seq(req, RequestRecord(0, 0, 0.0, len(prompt), len(answer)), 0)
    seq.prompt, seq.output = array("i", prompt), array("i", answer)
    whole = prompt + answer
    start = data.draw(st.integers(0, len(whole)))
    stop = data.draw(st.integers(start, len(whole)))
    got = seq.span(start, stop)
    assert got.typecode == "i" and got.tolist() == whole[start:stop]
    if (start, stop) == (0, len(prompt)):
        assert got is seq.prompt  # the prompt itself, not a copy
