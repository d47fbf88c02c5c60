"""Golden captures recorded from vLLM's and SGLang's own event code (tests/data/engines/):
the decoder reads every event of every version, live and replayed, and a Router with default
arguments rebuilds each worker's cache from them: the state each stream implies (from the
recording script's scenario, not from this project's code) and the prefixes route() finds."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.tools.capture import read_capture
from events.tools.cli import main as cli_main
from events.wire.codec import decode_batch, encode_batch
from events.wire.model import (
    AllBlocksCleared,
    Created,
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
    cache_level_of,
)
from kvcache.hashing import chain_hashes
from router_sim.router.indexer import engine_clear_scope
from router_sim.router.load import StaticLoadSource, WorkerLoad
from router_sim.router.routing import Router

ENGINES = Path(__file__).parent / "data" / "engines"
NAMES = sorted(p.name for p in ENGINES.iterdir() if (p / "stream.jsonl").is_file())
END = b"\xff" * 8


def _load(name: str) -> tuple[list[DecodedBatch], list[DecodedBatch], list[list[bytes]], Any]:
    """(live batches, replayed batches, raw replay replies, expected.json)."""
    capture = read_capture(ENGINES / name / "stream.jsonl")
    live = [decode_batch(m.frames[2]) for m in capture.messages if not m.replay]
    replies = [list(m.frames) for m in read_capture(ENGINES / name / "replay_raw.jsonl").messages]
    replayed = [decode_batch(r[-1]) for r in replies if r[-2] != END]
    expected = json.loads((ENGINES / name / "expected.json").read_text())
    return live, replayed, replies, expected


def _router(name: str | None = None) -> Router:
    """A default Router; with a capture's ``name``, told the engine's meaning of a clear."""
    router = Router(16, "kv_overlap", StaticLoadSource({0: WorkerLoad()}))
    if name is not None:
        router.indexer.set_clear_scope(0, engine_clear_scope(name.split("-")[0]))
    return router


def _overlap(router: Router, route: dict[str, Any]) -> int:
    decision = router.route(
        route["tokens"],
        lora_id=route.get("lora_id"),
        lora_name=route["lora_name"],
        cache_salt=route["salt"],
    )
    return decision.overlaps[0]


def _limit(router: Router, route: dict[str, Any]) -> tuple[int, int | None]:
    """What worker 0's engine reuses of the route's prompt, and the group that limited it."""
    keys = router.hash_request(route["tokens"], lora_name=route["lora_name"])
    return router.indexer.prefix_hit(0, keys)


def test_every_engine_capture_is_present() -> None:
    versions = {n.split("-")[0] + "-" + n.split("-")[1] for n in NAMES}
    assert versions == {
        "vllm-0.11.0",
        "vllm-0.25.1",
        "vllm-0.26.0",
        "vllm-0.33.0",
        "sglang-0.5.23",
    }


@pytest.mark.parametrize("name", NAMES)
def test_every_event_decodes_live_and_replayed(name: str) -> None:
    live, replayed, replies, expected = _load(name)
    assert len(live) == expected["batches"]
    assert all(b.malformed == [] for b in live + replayed)
    assert sum(len(b.events) for b in live) == expected["events"]
    assert replayed == live
    # the replay reply ends with the end marker; vLLM <= 0.25.1 sends no topic frame
    assert replies[-1][-2] == END
    no_topic = name.startswith(("vllm-0.11", "vllm-0.25"))
    assert {len(r) for r in replies} == ({3} if no_topic else {4})


@pytest.mark.parametrize("name", NAMES)
def test_engine_shapes_decode_to_their_meaning(name: str) -> None:
    live, _, _, _ = _load(name)
    stores = [e.data for b in live for e in b.events if isinstance(e.data, Stored)]
    removals = [e.data for b in live for e in b.events if isinstance(e.data, Removed)]
    if name.startswith("vllm"):
        placeholders = [s for s in stores if not s.masked and all(not b.tokens for b in s.blocks)]
        assert placeholders, "the CPU-offload placeholder stores are kept"
        assert all(b.cache_level == cache_level_of("CPU") for b in placeholders[0].blocks)
        salted = [s for s in stores if s.salt is not None]
        # vLLM 0.11 publishes neither the salt nor the adapter's name
        assert [s.salt for s in salted] == ([] if "0.11" in name else ["tenant-a"])
        if not name.startswith("vllm-0.11"):
            assert [s.lora_name for s in stores if s.lora_name] == ["adapter-a"]
            masked = [s for s in stores if s.masked]
            assert len(masked) == 1 and masked[0].group == 1 and len(masked[0].blocks) == 2
            assert {r.group for r in removals} >= {0, 1}
        if "bin" in name:
            size = int(name.rsplit("bin", 1)[1])
            assert all(isinstance(b.block_hash, str) for s in stores for b in s.blocks)
            assert {len(str(b.block_hash)) for s in stores for b in s.blocks} == {2 * size}
        tiers = {b.cache_level for s in stores for b in s.blocks}
        extra = {"0.26": "FS", "0.33": "STORAGE"}.get(name.split("-")[1][:4])
        assert tiers == {0, 1} | ({cache_level_of(extra)} if extra else set())
        assert cache_level_of(extra or "CPU") != 0
    else:
        assert any(s.salt == "tenant-a" for s in stores)
        assert any(s.lora_name == "adapter-a" for s in stores)
        host = cache_level_of("CPU_PINNED")  # SGLang's host tier is the host tier (CPU)
        assert host == cache_level_of("CPU") == 1
        assert any(b.cache_level == host for s in stores for b in s.blocks)
        partial = [s for s in stores if s.block_size == 4]
        assert len(partial) == 1 and len(partial[0].blocks[0].tokens) == 4
        bigram = [s for s in stores if s.block_size == 16 and len(s.blocks) == 2 and s.salt is None]
        assert bigram, "the bigram page store decodes"


@pytest.mark.parametrize("name", NAMES)
def test_router_with_defaults_finds_the_announced_prefixes(name: str) -> None:
    live, _, _, expected = _load(name)
    router = _router(name)
    checks = expected["before_clear_routes"]
    hybrid: dict[str, Any] = expected.get("hybrid", {})
    assert bool(hybrid) == (name.startswith("vllm") and "0.11" not in name)
    index = router.indexer
    host_copies: list[object] = []  # SGLang's keys of the copy on its host tier, before a clear
    for i, batch in enumerate(live):
        if any(isinstance(e.data, AllBlocksCleared) for e in batch.events):
            for where, hashes in expected.get("held_if_clear_keeps_host", {}).items():
                group = int(where.split("/")[1]) or None
                host_copies += [index.key_of(0, h % 2**64, group) for h in hashes]
                assert all(1 in index.holds(0, k) for k in host_copies)  # type: ignore[arg-type]
        router.apply(0, batch)
        for route in (r for r in checks if r["after_batch"] == i):
            assert _overlap(router, route) == route["blocks"], (i, route["blocks"])
        for route in (r for r in hybrid.get("routes", []) if r["after_batch"] == i):
            assert _overlap(router, route) == route["blocks"], (i, route["blocks"])
            assert _limit(router, route) == (route["blocks"], route["limited_by"])
    # a hybrid model's sliding-window group decides its routes (expected.json: "hybrid")
    for route in hybrid.get("final_routes", expected["routes"]):
        assert _overlap(router, route) == route["blocks"]
        if "limited_by" in route:
            assert _limit(router, route) == (route["blocks"], route["limited_by"])
    index = router.indexer
    anomalies = index.worker_anomalies(0)
    # the sliding-window store's two masked blocks are keyed from the trailing token ids (the
    # blocks before the window are the ones left out); nothing is odd
    assert anomalies == dict.fromkeys(anomalies, 0)
    assert index.worker_status(0).keying == "tokens"
    held = dict(expected["held"])
    # SGLang's clear emptied its host tier too: the copy written back before it is gone
    assert all(index.holds(0, k) == () for k in host_copies)  # type: ignore[arg-type]
    assert bool(host_copies) == name.startswith("sglang")
    want: dict[object, set[int]] = {}
    for where, hashes in held.items():
        medium, group = where.split("/")
        for h in hashes:
            h = h % 2**64 if isinstance(h, int) else h
            key = index.key_of(0, h, int(group) or None)
            want.setdefault(key, set()).add(cache_level_of(medium))
    assert {k: set(index.holds(0, k)) for k in want} == want  # type: ignore[arg-type]
    assert index.block_count(0) == len(want)


def test_a_mixed_fleet_routes_with_one_default_router() -> None:
    """vLLM, SGLang and this project's workers behind one Router(): a prompt stored on one
    worker is found on that worker only."""
    router = Router(16, "kv_overlap", StaticLoadSource({w: WorkerLoad() for w in range(3)}))
    vllm, _, _, v_expected = _load("vllm-0.33.0")
    sglang, _, _, s_expected = _load("sglang-0.5.23")
    for batch in vllm[:3]:  # up to its sliding-window group's store
        router.apply(0, batch)
    for batch in sglang:
        router.apply(1, batch)
    tokens = list(range(1000, 1048))
    hashes = chain_hashes(tokens, 16)
    blocks = [StoredBlock(h, tokens[16 * i : 16 * (i + 1)]) for i, h in enumerate(hashes)]
    router.apply(2, decode_batch(encode_batch([KVCacheEvent(0, Stored(None, blocks, 16))], 0.0)))
    assert router.route(tokens).overlaps == {0: 0, 1: 0, 2: 3}
    assert router.indexer.worker_status(2).native
    assert not router.indexer.worker_status(0).native
    v_route, s_route = v_expected["hybrid"]["routes"][0], s_expected["routes"][0]
    assert v_route["after_batch"] == 2
    decision = router.route(v_route["tokens"])
    assert decision.overlaps == {0: 4, 1: 0, 2: 0}
    # the explanation names the group that cut worker 0's 6 blocks to 4: its sliding window
    assert decision.limited_by == {0: 1}
    assert router.route(tokens).limited_by == {}
    assert router.route(s_route["tokens"]).overlaps == {0: 0, 1: 3, 2: 0}
    assert router.route(v_route["tokens"]).worker == 0
    assert router.route(s_route["tokens"]).worker == 1


def test_a_worker_without_token_ids_is_keyed_by_its_hashes_and_says_so() -> None:
    live, _, _, _ = _load("vllm-0.33.0")
    router = _router()
    placeholder_only = [
        DecodedBatch(
            b.ts, [e for e in b.events if isinstance(e.data, Stored) and e.data.block_size == 0]
        )
        for b in live
    ]
    for batch in placeholder_only:
        router.apply(0, batch)
    status = router.indexer.worker_status(0)
    assert status.keying == "engine_hashes" and status.keyed_by_tokens == 0
    assert router.indexer.worker_anomalies(0)["unkeyed_block"] > 0


RULES = json.loads((ENGINES / "decoder_rules.json").read_text())


def _project_batch() -> list[KVCacheEvent]:
    blocks = [StoredBlock(2**64 - 1 - i, list(range(i, i + 16)), 3, 1, 35, 7) for i in range(2)]
    return [
        KVCacheEvent(0, Created([100, 200])),
        KVCacheEvent(1, Stored(None, blocks, 16)),
        KVCacheEvent(2, Updated(2**64 - 1, cache_level=EventDiff(1, 0))),
        KVCacheEvent(3, Updated(2**64 - 2, priority=EventDiff(35, 80))),
        KVCacheEvent(4, Removed([2**64 - 2], 0)),
        KVCacheEvent(5, AllBlocksCleared()),
    ]


def _satisfies(events: list[Any], rules: dict[str, Any]) -> None:
    """Each event has a tag the engine knows and every field its struct requires."""
    for event in events:
        if isinstance(event, dict):
            rule = rules[event["type"]]
            assert not rule["array_like"]
            required = {name for name, req in rule["fields"] if req}
            assert required <= set(event), (event["type"], required - set(event))
            hashes = event.get("block_hashes", [])
            assert all(type(h) is int and 0 <= h < 2**64 for h in hashes)
        else:
            rule = rules[event[0]]
            assert rule["array_like"]
            names = [name for name, _ in rule["fields"]]
            required = sum(1 for _, req in rule["fields"] if req)
            assert required <= len(event) - 1 <= len(names)


@pytest.mark.parametrize("name", sorted(RULES))
def test_what_this_project_sends_by_default_decodes_in_each_engine(name: str) -> None:
    """Structural check against the structs recorded from each release; the recording script
    also ran the engines' own decoders on this encoder's output (recorded verdicts)."""
    rules = RULES[name]["events"]
    positional = any(r["array_like"] for r in rules.values())
    form = "positional" if positional else "map"
    payload = encode_batch(_project_batch(), 1.0, 0, form=form)
    events = msgpack.unpackb(payload, raw=False)[1]
    assert [e["type"] if isinstance(e, dict) else e[0] for e in events] == [
        "BlockStored",
        "BlockRemoved",  # the tier move: removed from the old medium ...
        "BlockStored",  # ... and a placeholder on the new one; the priority change is dropped
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    _satisfies(events, rules)
    assert RULES[name]["this_project_encoder"][form].startswith("ok")
    extended = msgpack.unpackb(encode_batch(_project_batch(), 1.0, 0, extensions=True))[1]
    assert {"CacheCreated", "BlockUpdated"} <= {e["type"] for e in extended}
    assert not set(rules) & {"CacheCreated", "BlockUpdated"}  # extensions: only when asked


def test_the_default_tier_move_keeps_a_router_exact() -> None:
    """A move sent as Removed + placeholder Stored leaves the index as the extension event
    would: the block on its new tier, under the key it already had."""
    tokens = list(range(2000, 2032))
    hashes = chain_hashes(tokens, 16)
    blocks = [StoredBlock(h, tokens[16 * i : 16 * (i + 1)]) for i, h in enumerate(hashes)]
    move = KVCacheEvent(1, Updated(hashes[1], cache_level=EventDiff(0, 1)))
    for extensions in (False, True):
        router = _router()
        for events in ([KVCacheEvent(0, Stored(None, blocks, 16))], [move]):
            router.apply(0, decode_batch(encode_batch(events, 0.0, extensions=extensions)))
        index = router.indexer
        assert [index.holds(0, index.key_of(0, h)) for h in hashes] == [(0,), (1,)]
        detail = index.find_matches_detailed(hashes)[0]
        assert (detail.matched_blocks, detail.device_run) == (2, 1)


@pytest.mark.parametrize("name", NAMES)
def test_doctor_recognizes_engine_hashes_and_passes_a_healthy_capture(
    name: str,
) -> None:
    out = io.StringIO()
    code = cli_main(["doctor", str(ENGINES / name / "stream.jsonl")], out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "block hashes are the engine's own" in text
    # engine-native hashes are their own verdict, never a plain OK (--require-verified: 3)
    assert "result: ENGINE-NATIVE HASHES, NOT CHECKED" in text and "result: OK" not in text


def test_doctor_still_flags_a_mis_salted_native_stream() -> None:
    """The recognition must not hide this project's own hash bugs (an explained mismatch)."""
    capture = Path(__file__).parent / "data" / "captures" / "salt_not_mixed.jsonl"
    out = io.StringIO()
    assert cli_main(["doctor", str(capture)], out=out) == 1
    assert "engine's own" not in out.getvalue()


# --- property: a worker's own hashes never change what the router sees ------------------------

PROMPTS = st.lists(st.lists(st.integers(0, 3), min_size=16, max_size=16), min_size=1, max_size=4)


@st.composite
def engine_runs(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Operations on a small cache: store prompt p's first n blocks (as a continuation of
    what is stored when it is), remove block i of prompt p at a tier, clear."""
    ops = st.one_of(
        st.tuples(st.just("store"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("offload"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
    )
    return draw(st.lists(ops, max_size=25))


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(PROMPTS, min_size=4, max_size=4), run=engine_runs(), salt=st.integers())
def test_engine_hashes_index_exactly_as_native_hashes(
    prompts: list[list[list[int]]], run: list[tuple[str, int, int]], salt: int
) -> None:
    """The same cache history announced under V1 hashes (this project's worker) and under
    opaque per-worker hashes (an engine's) leaves the default router's index identical."""
    rng = random.Random(salt)
    engine_of: dict[int, int] = {}

    def engine(h: int) -> int:
        return engine_of.setdefault(h, rng.getrandbits(64))

    router = Router(16, "kv_overlap", StaticLoadSource({0: WorkerLoad(), 1: WorkerLoad()}))
    chains = [chain_hashes([t for b in p for t in b], 16) for p in prompts]
    stored: dict[int, int] = {}  # prompt -> blocks stored (a prefix)
    for op, p, n in run:
        events: list[KVCacheEvent] = []
        n = min(n, len(chains[p]))
        if op == "store" and n > stored.get(p, 0):
            start = stored.get(p, 0)
            blocks = [StoredBlock(chains[p][i], prompts[p][i]) for i in range(start, n)]
            parent = chains[p][start - 1] if start else None
            events.append(KVCacheEvent(0, Stored(parent, blocks, 16)))
            stored[p] = n
        elif op in ("remove", "offload") and n < stored.get(p, 0):
            h = chains[p][n]
            events.append(KVCacheEvent(0, Removed([h], 0)))
            if op == "offload":
                events.append(KVCacheEvent(0, Stored(None, [StoredBlock(h, [], cache_level=1)], 0)))
        elif op == "clear":
            events.append(KVCacheEvent(0, AllBlocksCleared()))
            stored.clear()
        if not events:
            continue
        router.apply(0, DecodedBatch(0.0, events))
        renamed = []
        for e in events:
            d = e.data
            if isinstance(d, Stored):
                parent = None if d.parent_hash is None else engine(int(d.parent_hash))
                blocks = [
                    StoredBlock(engine(int(b.block_hash)), b.tokens, cache_level=b.cache_level)
                    for b in d.blocks
                ]
                d = Stored(parent, blocks, d.block_size)
            elif isinstance(d, Removed):
                d = Removed([engine(int(h)) for h in d.block_hashes], d.cache_level)
            renamed.append(KVCacheEvent(0, d))
        router.apply(1, DecodedBatch(0.0, renamed))
    index = router.indexer
    if all(op != "clear" for op, _, _ in run):  # the two clears differ on purpose
        assert [index.find_matches_detailed(c).get(0) for c in chains] == [
            index.find_matches_detailed(c).get(1) for c in chains
        ]
        assert index.block_count(0) == index.block_count(1)
        for chain in chains:  # every block under the same key and on the same tiers
            mapped = [index.key_of(1, engine_of[h]) if h in engine_of else h for h in chain]
            assert [index.holds(1, k) for k in mapped] == [index.holds(0, h) for h in chain]
    for chain in chains:
        detail = index.find_matches_detailed(chain)
        native, engine_worker = detail.get(0), detail.get(1)
        if native is None or engine_worker is None:
            assert native is None
            # the engine worker may still hold slower copies that the native one cleared with
            # its AllBlocksCleared (an engine's clear resets the device tier only)
            continue
        assert engine_worker.device_run == native.device_run
        assert engine_worker.matched_blocks >= native.matched_blocks
    if any(op == "store" for op, _, _ in run):
        assert index.worker_status(0).native and not index.worker_status(1).native
