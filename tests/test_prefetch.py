"""The replay's prompt thread (router_sim.sim.prefetch) against the inline path it stands in for,
and a cache's commit with keys made by the caller (create_kv_cache(block_keys=...))."""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.keys import blockchain_keys, root_key
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from kvcache.sink import RecordingSink
from router_sim.router.load import StaticLoadSource, WorkerLoad
from router_sim.router.routing import Router
from router_sim.sim import prefetch
from router_sim.sim.simulator import SimConfig, simulate
from router_sim.sim.trace import load_trace
from router_sim.sim.workloads import Request

pytestmark = pytest.mark.skipif(not prefetch.NATIVE, reason="router_sim.sim._prefetch not built")

TPB = 64


def _requests() -> list[Request]:
    """Trace requests under three scopes (none, an adapter, an adapter and a salt), a
    request with a given prompt (not the thread's) and one shorter than a block."""
    base = load_trace("mooncake")[:120]
    out: list[Request] = []
    for i, r in enumerate(base):
        kw: dict[str, Any] = {"request_id": i}
        if i % 3 == 1:
            kw["lora_id"] = 7
        elif i % 3 == 2:
            kw.update(lora_id=3, cache_salt="tenant-b")
        out.append(
            Request(
                request_id=i,
                arrival_ms=r.arrival_ms,
                input_length=r.input_length,
                output_length=r.output_length,
                hash_ids=r.hash_ids,
                lora_id=kw.get("lora_id"),
                cache_salt=kw.get("cache_salt"),
            )
        )
    out.append(
        Request(
            request_id=900,
            arrival_ms=1e9,
            input_length=3,
            output_length=2,
            prompt=array("i", [1, 2, 3]),
        )
    )
    out.append(
        Request(request_id=901, arrival_ms=1e9, input_length=5, output_length=2, hash_ids=(4, 5))
    )
    return out


def test_each_request_gets_what_the_inline_path_computes() -> None:
    reqs = _requests()
    scopes = [r.scope for r in reqs]
    source = prefetch.prompt_source(reqs, scopes, TPB, True)
    assert source is not None
    router = Router(TPB, "round_robin", StaticLoadSource({0: WorkerLoad()}))
    keyed = bool(prefetch.KEYS)
    try:
        for req, scope in zip(reqs, scopes, strict=True):
            made = source.take()
            if req.prompt is not None:
                assert made is None  # a given prompt is hashed inline
                continue
            assert made is not None
            hashes, keys = made
            tokens = req.tokens()
            assert hashes == router.hash_request(tokens, scope)
            if keyed:
                assert keys == blockchain_keys(scope, tokens, TPB)[: len(tokens) // TPB]
            else:
                assert keys is None
    finally:
        source.close()
    # a scope's keys differ from another's: the thread chained each from its own root
    assert len({root_key(s) for s in scopes}) == 3


def test_the_cache_keys_chain_sha256_over_little_endian_tokens() -> None:
    # hand-derived: key = sha256(parent || 4-byte LE tokens), from sha256(scope bytes)
    if not prefetch.KEYS:
        pytest.skip("keys are made inline on a big-endian CPU")
    req = Request(request_id=0, arrival_ms=0.0, input_length=TPB, output_length=1, hash_ids=(11,))
    source = prefetch.prompt_source([req], [req.scope], TPB, False)
    assert source is not None
    made = source.take()
    source.close()
    assert made is not None and made[0] is None
    tokens = req.tokens()
    expect = hashlib.sha256(
        hashlib.sha256(req.scope.to_bytes()).digest()
        + b"".join(t.to_bytes(4, "little") for t in tokens)
    ).digest()
    assert made[1] == [expect]


def test_the_whole_report_is_the_same_with_and_without_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reqs = _requests()[:-2]
    config = SimConfig(workers=3, tokens_per_block=TPB, device_blocks=3000)
    skip = {"wall_s", "decision_us_p50", "decision_us_p99", "decision_us_mean"}
    reports = []
    for enabled in (True, False):
        monkeypatch.setattr(prefetch, "ENABLED", enabled)
        summary = simulate(reqs, "kv_overlap", config)
        d = {k: v for k, v in summary.as_dict().items() if k not in skip}
        records = [(r.worker, r.reused_tokens, r.first_token_ms) for r in summary.records]
        reports.append((d, records))
    assert reports[0] == reports[1]
    assert reports[0][0]["hit_rate"] > 0  # the keys did meet: prompts were reused


def test_take_past_the_end_and_after_close_answers_at_once() -> None:
    reqs = _requests()[:5]
    source = prefetch.prompt_source(reqs, [r.scope for r in reqs], TPB, True)
    assert source is not None
    for _ in range(5):
        source.take()
    assert len(source) == 0  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        source.take()
    many = load_trace("mooncake")[:3000]
    source = prefetch.prompt_source(many, [r.scope for r in many], TPB, True)
    assert source is not None
    source.close()
    taken = 0
    with pytest.raises((RuntimeError, IndexError)):
        while True:  # what was made before the close, then an error: never a wait
            source.take()
            taken += 1
    assert taken <= len(many)
    source.close()  # twice is fine


@pytest.mark.parametrize(
    "job, error",
    [
        ((1, 2), TypeError),
        (((1, 2), 2000, None, None, True, None), ValueError),  # more tokens than ids give
        (((1, 2), 10, None, None, True, b"short"), TypeError),
        (((1, "x"), 600, None, None, True, None), TypeError),
        (((1, 2), 10, -1, None, True, None), ValueError),
    ],
)
def test_a_bad_job_is_refused_when_made(job: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        prefetch.Prefetch([job], 512, 21, (1 << 21) - 1, TPB, 8)  # type: ignore[list-item,misc]


def test_disabled_or_nothing_to_make_gives_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    given = [r for r in _requests() if r.prompt is not None]
    assert prefetch.prompt_source(given, [r.scope for r in given], TPB, True) is None
    reqs = _requests()[:3]
    monkeypatch.setattr(prefetch, "ENABLED", False)
    assert prefetch.prompt_source(reqs, [r.scope for r in reqs], TPB, True) is None


# ------------------------------------------------------------ create_kv_cache(block_keys=...)


def _manager() -> KVCacheManager:
    tiers = [TierConfig(name="device", num_blocks=64)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=4, tiers=tiers))


def _committed_keys(m: KVCacheManager) -> list[bytes]:
    return sorted(b.key for b in m.iter_blocks())


def test_given_keys_file_the_blocks_as_computed_ones_would() -> None:
    scope = ReuseScope(lora_id=5, salt=9)
    prompt = array("i", range(100, 114))  # three full blocks and two tokens
    plain, keyed = _manager(), _manager()
    for m, keys in ((plain, None), (keyed, blockchain_keys(scope, prompt, 4)[:3])):
        seq = m.create_kv_cache(prompt, scope, block_keys=keys)
        seq.commit(prompt[seq.num_reused_tokens :])
        seq.commit(array("i", [7, 7, 7]))  # a block past the keys: hashed here
        seq.close()
    assert _committed_keys(plain) == _committed_keys(keyed)
    again = keyed.create_kv_cache(prompt, scope)
    assert again.num_reused_tokens == len(prompt) - 1  # found by content, as any other
    again.close()


def test_given_keys_are_used_not_recomputed() -> None:
    # keys of other content are trusted (documented): the blocks are filed under them
    m = _manager()
    prompt = array("i", range(8))
    fake = [bytes([1]) * 32, bytes([2]) * 32]
    seq = m.create_kv_cache(prompt, block_keys=fake)
    seq.commit(prompt)
    seq.close()
    assert set(fake) <= {b.key for b in m.iter_blocks()}


def test_given_keys_find_the_cached_prefix_by_key() -> None:
    # the prefix is looked up by the keys given, not by the tokens (which are not packed,
    # compared or hashed): blocks filed under the keys are found for other tokens
    m = _manager()
    fake = [bytes([1]) * 32, bytes([2]) * 32]
    seq = m.create_kv_cache(array("i", range(8)), block_keys=fake)
    seq.commit(array("i", range(8)))
    seq.close()
    other = array("i", range(50, 59))  # two full blocks and one token, no content cached
    assert m.create_kv_cache(other).num_reused_tokens == 0
    keyed = m.create_kv_cache(other, block_keys=fake)
    assert keyed.num_reused_tokens == 8
    assert list(keyed.tokens) == list(range(8))  # what the cache holds: the blocks' tokens
    keyed.close()


@given(
    prompts=st.lists(
        st.tuples(
            st.integers(0, 2),  # scope
            st.lists(st.integers(0, 2), min_size=1, max_size=5),  # block contents
            st.integers(0, 3),  # tokens past the full blocks
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=60, deadline=None)
def test_given_keys_reuse_what_the_tokens_would(prompts: list[tuple[int, list[int], int]]) -> None:
    # full and partial reuse, three scopes: with every full block's key given, a manager
    # reuses the same blocks as one that matches by tokens, and holds the same tree after
    scopes = [ReuseScope(), ReuseScope(lora_id=2), ReuseScope(lora_id=2, salt=5)]
    plain, keyed = _manager(), _manager()
    for which, contents, extra in prompts:
        scope = scopes[which]
        tokens = array("i", [t for c in contents for t in (c, c + 1, c + 2, c + 3)])
        tokens.extend(range(90, 90 + extra))
        keys = blockchain_keys(scope, tokens, 4)[: len(tokens) // 4]
        reused = []
        for m, given_keys in ((plain, None), (keyed, keys)):
            seq = m.create_kv_cache(tokens, scope, block_keys=given_keys)
            reused.append((seq.num_reused_tokens, [b.uid for b in seq.held_blocks()]))
            seq.commit(tokens[seq.num_reused_tokens :])
            assert list(seq.tokens) == list(tokens)
            seq.close()
        assert reused[0] == reused[1]
    assert _committed_keys(plain) == _committed_keys(keyed)


def test_sink_hashes_reach_the_sink_with_their_blocks() -> None:
    # blocks i..j stored by a commit come with hashes i..j; reused and decode blocks without
    sink = RecordingSink()
    tiers = [TierConfig(name="device", num_blocks=64)]
    m = KVCacheManager(KVCacheManagerConfig(tokens_per_block=4, tiers=tiers), event_sink=sink)
    first = m.create_kv_cache(array("i", range(9)), sink_hashes=[1, 2])
    first.commit(array("i", range(9)))
    first.close()
    sink.clear()
    prompt = array("i", [*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58])  # 2 blocks reused
    seq = m.create_kv_cache(prompt, sink_hashes=[1, 2, 3, 4])
    assert seq.num_reused_tokens == 8
    seq.commit(prompt[8:12])
    seq.commit(prompt[12:])
    seq.commit(array("i", [9, 9, 9]))
    seq.close()
    stored = [(r.keys, r.hashes) for r in sink.records if r.kind == "stored"]
    assert [len(k) for k, _ in stored] == [1, 1, 1]  # block 2, block 3, a decode block
    assert [h for _, h in stored] == [(3,), (4,), ()]


@pytest.mark.parametrize("hashes", [[1, 2, 3], [-1], [2**64], ["1"], [1.0], b"ab"])
def test_bad_sink_hashes_are_refused(hashes: Any) -> None:
    m = _manager()
    with pytest.raises(ValueError):
        m.create_kv_cache(array("i", range(8)), sink_hashes=hashes)


@pytest.mark.parametrize(
    "keys",
    [b"x" * 32, [b"x" * 32] * 3, [b"short"], ["x" * 32]],
)
def test_bad_block_keys_are_refused(keys: Any) -> None:
    m = _manager()
    with pytest.raises(ValueError):
        m.create_kv_cache(array("i", range(8)), block_keys=keys)


@given(
    st.lists(
        st.one_of(
            st.binary(min_size=31, max_size=33),
            st.text(min_size=32, max_size=32),
            st.integers(),
            st.none(),
        ),
        max_size=6,
    )
)
def test_block_keys_are_taken_exactly_when_each_is_32_bytes(keys: list[Any]) -> None:
    """Up to one key per full block (6 here): refused unless every key is 32 bytes."""
    expected = all(type(k) is bytes and len(k) == 32 for k in keys)
    for given_keys in (keys, tuple(keys)):
        m = _manager()
        if expected:
            m.create_kv_cache(array("i", range(25)), block_keys=given_keys).close()
        else:
            with pytest.raises(ValueError, match="block_keys"):
                m.create_kv_cache(array("i", range(25)), block_keys=given_keys)


@given(
    st.lists(
        st.one_of(st.integers(-(2**65), 2**65), st.booleans(), st.floats(), st.binary()),
        max_size=6,
    )
)
def test_sink_hashes_are_taken_exactly_when_each_is_a_64_bit_int(hashes: list[Any]) -> None:
    expected = all(type(h) is int and 0 <= h < 2**64 for h in hashes)
    for given_hashes in (hashes, tuple(hashes)):
        m = _manager()
        if expected:
            m.create_kv_cache(array("i", range(25)), sink_hashes=given_hashes).close()
        else:
            with pytest.raises(ValueError, match="sink_hashes"):
                m.create_kv_cache(array("i", range(25)), sink_hashes=given_hashes)
