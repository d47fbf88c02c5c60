"""The compulsory-miss bound: exact on hand-made workloads, scopes respected, Mooncake figure."""

from __future__ import annotations

import gzip
import json
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_sim.sim.bound import blocks_reused, compulsory_bound, reusable_tokens
from router_sim.sim.trace import load_trace, resolve_trace
from router_sim.sim.workloads import Request

SHARED = [
    Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mooncake",
    Path("/work/shared/data/mooncake"),
]


def _req(
    i: int, tokens: list[int], salt: str | None = None, out: list[int] | None = None
) -> Request:
    output = array("i", out) if out is not None else None
    return Request(
        request_id=i,
        arrival_ms=float(i),
        input_length=len(tokens),
        output_length=len(out) if out else 1,
        cache_salt=salt,
        prompt=array("i", tokens),
        output=output,
    )


def test_hand_made_workload_bound_is_exact() -> None:
    a = list(range(1, 9))  # 8 tokens: two blocks of 4
    reqs = [
        _req(0, a),  # nothing before: 0
        _req(1, [*a, 20, 21]),  # all of a: 8
        _req(2, [1, 2, 3, 4, 5, 6, 99]),  # 6 tokens, inside the second block
        _req(3, a, salt="other"),  # another scope: 0
        _req(4, [1, 2, 3]),  # a prefix of a seen prompt: all 3
    ]
    assert reusable_tokens(reqs) == [0, 8, 6, 0, 3]
    bound = compulsory_bound(reqs, tokens_per_block=4)
    assert bound.reusable == (0, 8, 6, 0, 2)  # the last prompt token is always computed
    assert bound.hit_tokens == 16 and bound.total_tokens == 36
    assert bound.token_hit_rate == pytest.approx(16 / 36)
    uncapped = compulsory_bound(reqs, tokens_per_block=4, recompute_last_token=False)
    assert uncapped.hit_tokens == 17
    # blocks: r0 0/2, r1 2/3, r2 1/2 (the partial block is not entirely reused), r3 0/2,
    # r4 1/1 (its only, partial, block is entirely reused)
    assert (bound.hit_blocks, bound.total_blocks) == (4, 10)
    assert bound.block_hit_rate == pytest.approx(0.4)


def test_answers_are_computed_once_and_reusable_by_the_next_turn() -> None:
    first = _req(0, [1, 2, 3, 4], out=[7, 7, 7])
    second = _req(1, [1, 2, 3, 4, 7, 7, 7, 9])
    assert reusable_tokens([first, second]) == [0, 7]


def test_hash_id_requests_bound_is_exact() -> None:
    def r(i: int, ids: tuple[int, ...], n: int) -> Request:
        return Request(i, float(i), n, 1, hash_ids=ids, tokens_per_hash_id=4)

    reqs = [r(0, (0, 1), 6), r(1, (0, 1, 2), 10), r(2, (0, 3), 5), r(3, (0, 1), 8)]
    # r1: id 0 full (4) + id 1 seen with 2 tokens of its 4 (2) -> 6 then stop
    # r2: id 0 (4), id 3 unseen -> 4;  r3: ids 0, 1 (1 seen with 4 tokens by r1) -> 8
    assert reusable_tokens(reqs) == [0, 6, 4, 8]
    # the id path and the token path agree
    explicit = [_req(q.request_id, list(q.tokens())) for q in reqs]
    assert reusable_tokens(explicit) == [0, 6, 4, 8]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(0, 4)),
        min_size=1,
        max_size=12,
    )
)
def test_hash_id_path_equals_the_token_path(rows: list[tuple[list[int], int]]) -> None:
    """Requests given by hash ids (4 tokens each, the last block cut short or whole) reuse what
    the same prompts given as tokens reuse: the id trie against the token trie."""
    reqs = [
        Request(i, float(i), 4 * len(ids) - cut, 1, hash_ids=tuple(ids), tokens_per_hash_id=4)
        for i, (ids, cut) in enumerate(rows)
        if 4 * len(ids) - cut > 0
    ]
    explicit = [_req(q.request_id, list(q.tokens())) for q in reqs]
    assert reusable_tokens(reqs) == reusable_tokens(explicit)


def test_salts_separate_identical_prompts() -> None:
    prompt = list(range(100, 140))
    pooled = [_req(i, prompt) for i in range(4)]
    salted = [_req(i, prompt, salt=f"t{i % 2}") for i in range(4)]
    assert compulsory_bound(pooled, 8).token_hit_rate == pytest.approx(3 * 39 / 160)
    assert compulsory_bound(salted, 8).token_hit_rate == pytest.approx(2 * 39 / 160)


def test_blocks_reused_counts_whole_blocks_only() -> None:
    assert blocks_reused(0, 10, 4) == (0, 3)
    assert blocks_reused(7, 10, 4) == (1, 3)
    assert blocks_reused(10, 10, 4) == (3, 3)
    assert blocks_reused(8, 8, 4) == (2, 2)


SEGMENTS = [list(range(s * 1000, s * 1000 + 30)) for s in range(3)]


@st.composite
def _sequence(draw: st.DrawFn) -> list[int]:
    # whole segments (so long prefixes are shared across trie chunks) plus a short random tail
    parts = draw(st.lists(st.sampled_from(range(len(SEGMENTS))), min_size=0, max_size=5))
    tail = draw(st.lists(st.integers(0, 3), min_size=0, max_size=6))
    tokens = [t for p in parts for t in SEGMENTS[p]] + tail
    return tokens or [0]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_sequence(), st.sampled_from([None, "a", "b"])), min_size=1, max_size=10))
def test_bound_is_the_longest_common_prefix_with_an_earlier_sequence(
    seqs: list[tuple[list[int], str | None]],
) -> None:
    reqs = [_req(i, toks, salt=salt) for i, (toks, salt) in enumerate(seqs)]
    expected = []
    for i, req in enumerate(reqs):
        best = 0
        for prev in reqs[:i]:
            if prev.cache_salt != req.cache_salt:
                continue
            seen = list(prev.tokens()) + list(prev.output_tokens())
            n = 0
            for x, y in zip(req.tokens(), seen, strict=False):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        expected.append(best)
    assert reusable_tokens(reqs) == expected


def test_mooncake_conversation_trace_bound() -> None:
    try:
        path = resolve_trace("mooncake")
    except FileNotFoundError:
        shared = next((p for p in SHARED if p.exists()), None)
        if shared is None:
            pytest.skip("no Mooncake trace: neither the bundled copy nor ../shared/data/mooncake")
        path = shared / "conversation_trace.jsonl"
    reqs = load_trace(path)
    bound = compulsory_bound(reqs, tokens_per_block=512)
    # A naive model read straight from the trace's rows: hash id i stands for the i-th 512
    # tokens of a prompt (the last id for the rest), ids chain their prefix, so a block is
    # reused when its id was computed before with at least as many tokens.
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    seen: dict[int, int] = {}
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    for row in rows:
        ids, n = row["hash_ids"], row["input_length"]
        sizes = [512] * (len(ids) - 1) + [n - 512 * (len(ids) - 1)]
        reused = 0
        for h, size in zip(ids, sizes, strict=True):
            if seen.get(h, 0) < size:
                reused += seen.get(h, 0)
                break
            reused += size
            hit_blocks += 1
        hit_tokens += min(reused, n - 1)  # the last prompt token is always computed
        total_tokens += n
        total_blocks += len(ids)
        for h, size in zip(ids, sizes, strict=True):
            seen[h] = max(seen.get(h, 0), size)
    assert (bound.hit_blocks, bound.total_blocks) == (hit_blocks, total_blocks)
    assert (bound.hit_tokens, bound.total_tokens) == (hit_tokens, total_tokens)
    # the figures the model gives for the bundled conversation trace
    assert round(bound.block_hit_rate * 100, 2) == 36.64
    assert round(bound.token_hit_rate * 100, 2) == 37.36
