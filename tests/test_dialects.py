"""Simulated workers speak vLLM's, SGLang's and TensorRT-LLM's KV-event dialects, and the router
routes all of them alike (router_sim.sim.dialects, ``router-sim run --engine``).

The shapes checked here are those of the engines' own captures (tests/data/engines/*/README.md):
vLLM's 64-bit hashes of its own under a per-process seed, ``lora_name`` and ``extra_keys`` (the
salt in a sequence's first block), ``group_idx``, CPU-offload placeholders; SGLang's signed
int64 hashes, ``cache_salt``, ``lora_name`` with ``lora_id`` nil, ``CPU_PINNED``; TensorRT-LLM's
V1 hashes. The router keys every block by its token ids, so routing decisions must be equal for
every engine, not merely close.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import msgspec
import pytest
import zmq

from events.wire.codec import decode_batch, encode_batch
from events.wire.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvcache.hashing import chain_hashes
from kvcache.scope import ReuseScope
from router_sim.cli import main
from router_sim.router.indexer import lora_name_id
from router_sim.sim.dialects import ENGINES, adapter_name, make_dialect, request_scope
from router_sim.sim.metrics import RequestRecord
from router_sim.sim.simulator import Restart, SimConfig, Simulation
from router_sim.sim.worker import Frame, SimWorker, WorkerConfig
from router_sim.sim.workloads import Request, SyntheticSpec, synthetic_workload

TPB = 16


def _prompt(seed: int, n: int) -> array[int]:
    return array("i", [(seed * 7919 + i * 104729) % 50_000 + 1 for i in range(n)])


def _requests() -> list[Request]:
    """A salted request, a LoRA request, and enough plain ones to push blocks to the host
    tier (8 device blocks) and out of it (8 host blocks)."""
    reqs = [
        Request(0, 0.0, 3 * TPB, 2, cache_salt="tenant-a", prompt=_prompt(1, 3 * TPB)),
        Request(1, 1.0, 2 * TPB + 5, 2, lora_id=3, prompt=_prompt(2, 2 * TPB + 5)),
    ]
    for i in range(2, 9):
        reqs.append(Request(i, float(i), 3 * TPB, 2, prompt=_prompt(10 + i, 3 * TPB)))
    return reqs


def _worker_frames(engine: str, worker_id: int = 0) -> list[Frame]:
    """The memory-transport frames one simulated worker publishes for :func:`_requests`."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    cfg = WorkerConfig(tokens_per_block=TPB, device_blocks=8, host_blocks=8, engine=engine)
    w = SimWorker(worker_id, cfg, context=ctx)
    try:
        w.announce()
        for req in _requests():
            record = RequestRecord(req.request_id, worker_id, req.arrival_ms, 0, 0)
            w.enqueue(req, record, req.arrival_ms, req.tokens())
            w.run_until(math.inf)
        return w.take_frames()
    finally:
        w.close()
        ctx.term()


def _frames(engine: str, worker_id: int = 0) -> list[list[Any]]:
    """The raw payloads ``[ts, events, dp_rank]`` one simulated worker publishes (a batch the
    memory transport hands over unwritten: as the ZeroMQ transports write it)."""
    payloads = [
        p if b is None else encode_batch(b.events, b.ts, b.dp_rank)
        for _, p, _, b in _worker_frames(engine, worker_id)
    ]
    for p in payloads:
        decode_batch(p)  # this project's decoder reads every dialect
    return [msgspec.msgpack.decode(p) for p in payloads]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_memory_transport_hands_over_what_the_payload_decodes_to(engine: str) -> None:
    """The memory transport gives the router a native worker's records without writing them:
    they must be what writing and decoding them gives (salted, LoRA and host-tier blocks
    included); an engine's payload, and a batch holding events the wire writes otherwise, is
    written and decoded."""
    frames = _worker_frames(engine)
    batches = [(payload, batch) for _, payload, kind, batch in frames if kind == "batch"]
    assert len(batches) > 3
    if engine != "native":
        assert all(batch is None for _, batch in batches)
        return
    handed = [(p, b) for p, b in batches if b is not None]
    assert len(handed) > len(batches) / 2  # all but the first (Created) and tier moves
    levels = set()
    for payload, batch in batches:
        if batch is None:
            continue
        assert payload == b""  # never written
        assert decode_batch(encode_batch(batch.events, batch.ts)) == batch
        levels |= {b.cache_level for e in batch.events for b in getattr(e.data, "blocks", [])}
    assert levels == {0, 1}  # stores to the host tier travelled too


def _events(frames: list[list[Any]], kind: str) -> list[dict[str, Any]]:
    return [e for f in frames for e in f[1] if e["type"] == kind]


def _v1(req: Request, scope: ReuseScope | None = None) -> list[int]:
    hashes = chain_hashes(req.tokens(), TPB, req.scope if scope is None else scope)
    return [int(h) for h in hashes]


def test_vllm_frames_have_vllms_shape() -> None:
    frames = _frames("vllm")
    assert all(f[2] == 0 for f in frames)  # the engine's data-parallel rank
    stored = _events(frames, "BlockStored")
    reqs = _requests()
    v1 = {h for r in reqs for h in _v1(r, request_scope("vllm", r))}
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert hashes and all(type(h) is int and 0 <= h < 2**64 for h in hashes)
    assert not v1 & set(hashes)  # its own hashes, not the V1 ones
    assert any(h >= 2**63 for h in hashes)
    # per-process seed: the same blocks on another worker hash differently
    assert not set(hashes) & {
        h for e in _events(_frames("vllm", 1), "BlockStored") for h in e["block_hashes"]
    }
    gpu = [e for e in stored if e["medium"] == "GPU"]
    assert all(e["group_idx"] == 0 for e in gpu)
    salted = [e for e in gpu if e.get("extra_keys") and "tenant-a" in e["extra_keys"][0]]
    assert len(salted) == 1 and salted[0]["parent_block_hash"] is None
    assert salted[0]["extra_keys"][1:] == [None] * (len(salted[0]["block_hashes"]) - 1)
    assert "cache_salt" not in salted[0] and "cache_salt_id" not in salted[0]
    lora = [e for e in gpu if e["lora_name"] is not None]
    assert {e["lora_name"] for e in lora} == {"adapter-3"} and {e["lora_id"] for e in lora} == {3}
    assert all(k == ["adapter-3"] for e in lora for k in e["extra_keys"])
    placeholders = [e for e in stored if e["medium"] == "CPU"]
    assert placeholders
    assert all(e["token_ids"] == [] and e["block_size"] == 0 for e in placeholders)
    removed = _events(frames, "BlockRemoved")
    assert removed and {h for e in removed for h in e["block_hashes"]} <= set(hashes)
    assert all(e.get("group_idx") == 0 for e in removed if e["medium"] == "GPU")


def test_sglang_frames_have_sglangs_shape() -> None:
    frames = _frames("sglang")
    stored = _events(frames, "BlockStored")
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert any(h < 0 for h in hashes) and all(-(2**63) <= h < 2**63 for h in hashes)
    v1 = {h for r in _requests() for h in _v1(r, request_scope("sglang", r))}
    assert not v1 & {h % 2**64 for h in hashes}
    # no per-process seed: another worker names the same blocks alike
    other = {h for e in _events(_frames("sglang", 1), "BlockStored") for h in e["block_hashes"]}
    assert set(hashes) == other
    assert {e.get("cache_salt") for e in stored} == {None, "tenant-a"}
    assert all("extra_keys" not in e and "cache_salt_id" not in e for e in stored)
    lora = [e for e in stored if "lora_name" in e]
    assert lora and all(e["lora_name"] == "adapter-3" and e["lora_id"] is None for e in lora)
    host = [e for e in stored if e["medium"] == "CPU_PINNED"]
    assert host and all(e["token_ids"] for e in host)
    assert {e["medium"] for e in stored} == {"GPU", "CPU_PINNED"}


@pytest.mark.parametrize(("engine", "dp_rank"), [("trtllm", 0), ("native", None)])
def test_v1_engines_publish_v1_hashes(engine: str, dp_rank: int | None) -> None:
    frames = _frames(engine)
    assert all(f[2] == dp_rank for f in frames)
    stored = _events(frames, "BlockStored")
    first = {e["block_hashes"][0] for e in stored if e["parent_block_hash"] is None}
    salted, lora = _requests()[:2]
    assert _v1(salted)[0] in first and _v1(lora)[0] in first
    assert {e.get("cache_salt_id") for e in stored} > {None}
    assert all(e["medium"] in ("GPU", "CPU") for e in stored)


def test_named_adapters_route_by_name() -> None:
    req = Request(0, 0.0, 20, 1, lora_id=7, cache_salt="t", prompt=_prompt(0, 20))
    assert request_scope("native", req) is req.scope
    assert request_scope("trtllm", req) is req.scope
    for engine in ("vllm", "sglang"):
        scope = request_scope(engine, req)
        assert scope == ReuseScope(lora_id=lora_name_id("adapter-7"), salt=req.scope.salt)
    assert adapter_name(7) == "adapter-7"


def _run(
    engine: str, policy: str, requests: int = 80, drop_rate: float = 0.0
) -> tuple[list[tuple[int, int]], float, int, dict[str, int]]:
    spec = SyntheticSpec()
    spec.num_requests = requests
    reqs = synthetic_workload("mixed", seed=3, spec=spec)
    cfg = SimConfig(
        workers=3,
        tokens_per_block=TPB,
        device_blocks=160,
        host_blocks=64,
        engine=engine,
        restarts=[Restart(1, reqs[requests // 2].arrival_ms)],
        drop_rate=drop_rate,  # > 0: real ZeroMQ sockets (inproc), lost frames replayed
    )
    sim = Simulation(policy, cfg)
    indexer = sim.router.indexer
    summary = sim.run(reqs)
    decisions = [(r.worker, r.predicted_overlap_blocks) for r in summary.records]
    reused = sum(r.reused_tokens for r in summary.records) / sum(r.input_length for r in reqs)
    return decisions, reused, summary.index_mismatch, indexer.anomalies


@pytest.mark.parametrize("policy", ["kv_overlap", "oracle"])
def test_routing_is_the_same_for_every_engine(policy: str) -> None:
    runs = {engine: _run(engine, policy) for engine in ENGINES}
    decisions, reused, mismatch, _ = runs["native"]
    assert reused > 0.2 and mismatch == 0
    assert sum(overlap for _, overlap in decisions) > 0
    for engine, (d, r, m, anomalies) in runs.items():
        assert m == 0, engine  # the index equals every worker's cache at the end
        assert d == decisions, engine
        assert r == reused, engine
        assert not any(anomalies.values()), (engine, anomalies)


def test_engine_streams_survive_loss_over_zeromq() -> None:
    # lost live frames come back through the publisher's replay, in the engine's shape
    decisions, reused, mismatch, _ = _run("native", "kv_overlap", 50, drop_rate=0.1)
    for engine in ("vllm", "sglang"):
        assert _run(engine, "kv_overlap", 50, drop_rate=0.1)[:3] == (decisions, reused, 0)
    assert mismatch == 0


@pytest.mark.parametrize("transport", ["memory", "inproc"])
def test_snapshots_key_every_block_of_an_engine(transport: str) -> None:
    # An overflowing event buffer is repaired by a snapshot. Memory transport: vLLM's
    # host-tier copies travel with their token ids there, not as keyless placeholders;
    # ZeroMQ: the publisher's snapshot names the engine's hashes and media, so the index
    # ends equal to the caches, as a native worker's does.
    def run(engine: str) -> tuple[list[tuple[int, int]], int, dict[str, int]]:
        spec = SyntheticSpec()
        spec.num_requests = 60
        reqs = synthetic_workload("mixed", seed=3, spec=spec)
        cfg = SimConfig(
            workers=3,
            tokens_per_block=TPB,
            device_blocks=160,
            host_blocks=64,
            engine=engine,
            event_buffer=20,
            transport=transport,
        )
        sim = Simulation("kv_overlap", cfg)
        indexer = sim.router.indexer
        summary = sim.run(reqs)
        records = [(r.worker, r.predicted_overlap_blocks) for r in summary.records]
        return records, summary.index_mismatch, indexer.anomalies

    native = run("native")
    assert native[1] == 0
    for engine in ("vllm", "sglang"):
        records, mismatch, anomalies = run(engine)
        assert (records, mismatch) == native[:2], engine
        if transport == "memory":
            # Over ZeroMQ the snapshot is taken whenever the publisher's thread serves the
            # request, so how many removals name blocks the index lost before it varies from
            # run to run (decisions and the final index do not); in memory it is exact.
            assert anomalies == native[2], engine


def test_cli_engine_flag(capsys: pytest.CaptureFixture[str]) -> None:
    rows: dict[str, str] = {}
    for engine in ENGINES:
        argv = ["run", "--workload", "tenants", "--max-requests", "40", "--workers", "2"]
        assert main([*argv, "--policies", "kv_overlap", "--engine", engine, "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert f"workers speak {engine}" in out.splitlines()[0]
        row = next(line for line in out.splitlines() if line.startswith("kv_overlap"))
        rows[engine] = " ".join(row.split()[:3])  # policy, hit%, of bound
    assert float(rows["native"].split()[1].rstrip("%")) > 0
    assert len(set(rows.values())) == 1, rows
    assert main(["run", "--engine", "tgi", "--max-requests", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engine" in err


def test_config_rejects_unknown_engines() -> None:
    with pytest.raises(ValueError, match="engine"):
        SimConfig(engine="tgi")
    with pytest.raises(ValueError, match="engine"):
        WorkerConfig(tokens_per_block=16, device_blocks=4, engine="vLLM")
    with pytest.raises(ValueError, match="v1_block_key"):
        SimConfig(engine="vllm", hash_algo="v2_sha256")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_partial_block_is_its_own_store(engine: str) -> None:
    # as vLLM 0.33 and SGLang send a trailing partial block / page (their captures)
    dialect = make_dialect(engine, 0, 4)
    blocks = [StoredBlock(11, [1, 2, 3, 4]), StoredBlock(12, [5, 6, 7, 8]), StoredBlock(13, [9])]
    payload = dialect.encode([KVCacheEvent(0, Stored(None, blocks, 4))], 0.5)
    ts, events, dp = msgspec.msgpack.decode(payload)
    assert (ts, dp) == (0.5, 0)
    assert [(e["block_size"], e["token_ids"]) for e in events] == [
        (4, [1, 2, 3, 4, 5, 6, 7, 8]),
        (1, [9]),
    ]
    assert events[1]["parent_block_hash"] == events[0]["block_hashes"][-1]
    assert events[0]["block_hashes"] == [dialect.engine_hash(11), dialect.engine_hash(12)]


def test_removals_of_an_engine_worker_name_its_hashes() -> None:
    # decoded: every removed hash was announced by a store of the same worker before
    frames = _frames("vllm")
    seen: set[int] = set()
    for f in frames:
        batch = decode_batch(msgspec.msgpack.encode(f))
        for ev in batch.events:
            if isinstance(ev.data, Stored):
                seen.update(int(b.block_hash) for b in ev.data.blocks)
            elif isinstance(ev.data, Removed):
                assert {int(h) for h in ev.data.block_hashes} <= seen
