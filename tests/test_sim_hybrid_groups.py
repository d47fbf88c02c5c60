"""``router-sim run --engine vllm --kv-groups``: simulated workers publish a hybrid model's
KV-cache groups as vLLM 0.33 does (router_sim.sim.dialects).

The layout is checked against vLLM 0.33's own capture of a hybrid model
(tests/data/engines/vllm-0.33.0/stream.jsonl): a store in group 0 carries ``group_idx`` only,
a sliding-window group's store carries ``group_idx``, ``kv_cache_spec_kind`` and
``kv_cache_spec_sliding_window``, GPU removals carry ``group_idx``, CPU-offload events none.
The simulated cache has no sliding window, so every group holds every block: a run with two
groups must route as a run with one, with the router's index holding each block in both.
"""

from __future__ import annotations

import base64
import json
import math
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from events.wire.codec import decode_batch
from events.wire.model import KVCacheEvent, Removed, Stored, StoredBlock
from router_sim.cli import main
from router_sim.sim.dialects import KvGroup, make_dialect, parse_kv_groups
from router_sim.sim.metrics import RequestRecord
from router_sim.sim.simulator import SimConfig, Simulation
from router_sim.sim.worker import SimWorker, WorkerConfig
from router_sim.sim.workloads import Request, SyntheticSpec, synthetic_workload

CAPTURE = Path(__file__).parent / "data" / "engines" / "vllm-0.33.0" / "stream.jsonl"
TPB = 16


def _capture_events() -> list[dict[str, Any]]:
    """Every event of vLLM 0.33's live stream, in order."""
    events: list[dict[str, Any]] = []
    for line in CAPTURE.read_text().splitlines():
        record = json.loads(line)
        if "frames" not in record:
            continue  # the header
        payload = base64.b64decode(record["frames"][-1])
        events.extend(msgspec.msgpack.decode(payload)[1])
    return events


def _one(events: list[dict[str, Any]], what: str, **match: Any) -> dict[str, Any]:
    found = [e for e in events if all(e.get(k, None) == v for k, v in match.items())]
    found = [e for e in found if "extra_keys" not in e]
    assert found, f"the capture has no {what}"
    return found[0]


def _capture_layouts() -> dict[str, dict[str, Any]]:
    """The capture's hybrid events, one of each kind."""
    events = _capture_events()
    stores = [e for e in events if e["type"] == "BlockStored"]
    removals = [e for e in events if e["type"] == "BlockRemoved"]
    sliding = [e for e in stores if e.get("group_idx", 0) != 0]
    assert len(sliding) == 1 and "kv_cache_spec_kind" in sliding[0]
    return {
        "full": _one(stores, "group 0 store", medium="GPU", group_idx=0, parent_block_hash=None),
        "sliding": sliding[0],
        "gpu_removed": _one(removals, "GPU removal", medium="GPU", group_idx=0),
        "cpu_stored": _one(stores, "CPU placeholder", medium="CPU"),
        "cpu_removed": _one(removals, "CPU removal", medium="CPU"),
    }


def _groups_like_the_capture() -> tuple[KvGroup, ...]:
    """Group 0 full attention, group 1 the capture's sliding window (kind and size)."""
    sliding = _capture_layouts()["sliding"]
    kind, window = sliding["kv_cache_spec_kind"], sliding["kv_cache_spec_sliding_window"]
    return parse_kv_groups(f"full,{kind}:{window}")


def test_two_groups_announce_each_store_and_gpu_removal_in_both_as_vllm_033() -> None:
    cap = _capture_layouts()
    groups = _groups_like_the_capture()
    dialect = make_dialect("vllm", 0, TPB, groups)
    tokens = [list(range(i * TPB + 1, (i + 1) * TPB + 1)) for i in range(3)]
    device = [StoredBlock(100 + i, t) for i, t in enumerate(tokens)]
    batch = [
        KVCacheEvent(0, Stored(None, device, TPB)),
        KVCacheEvent(1, Stored(102, [StoredBlock(103, list(range(5)))], TPB)),  # partial
        KVCacheEvent(2, Stored(None, [StoredBlock(200, tokens[0], cache_level=1)], TPB)),
        KVCacheEvent(3, Removed([101, 102], cache_level=0)),
        KVCacheEvent(4, Removed([200], cache_level=1)),
    ]
    payload = dialect.encode(batch, 1.5)
    ts, events, dp = msgspec.msgpack.decode(payload)
    assert (ts, dp) == (1.5, 0)
    gpu_stores = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    by_group = {g: [e for e in gpu_stores if e["group_idx"] == g] for g in (0, 1)}
    # every GPU store in both groups, same hashes and parents, in vLLM's field layout
    assert len(by_group[0]) == len(by_group[1]) == 2 and len(gpu_stores) == 4
    for full, window in zip(by_group[0], by_group[1], strict=True):
        assert list(full) == list(cap["full"])
        assert list(window) == list(cap["sliding"])
        for field in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"):
            assert window[field] == cap["sliding"][field]
        assert full["group_idx"] == cap["full"]["group_idx"]
        same = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium")
        assert [full[k] for k in same] == [window[k] for k in same]
    assert by_group[0][1]["parent_block_hash"] == by_group[0][0]["block_hashes"][-1]
    gpu_removed = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "GPU"]
    assert [e["group_idx"] for e in gpu_removed] == [0, 1]
    assert all(list(e) == list(cap["gpu_removed"]) for e in gpu_removed)
    assert gpu_removed[0]["block_hashes"] == gpu_removed[1]["block_hashes"]
    # the host tier once, without a group, as vLLM's offload connector sends it
    cpu_stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    cpu_removed = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"]
    assert [list(e) for e in cpu_stored] == [list(cap["cpu_stored"])]
    assert [list(e) for e in cpu_removed] == [list(cap["cpu_removed"])]
    # this project's decoder reads the groups and their spec back
    decoded = decode_batch(payload).events
    stored = [ev.data for ev in decoded if isinstance(ev.data, Stored) and ev.data.group]
    assert {(d.group, d.group_kind, d.sliding_window) for d in stored} == {
        (1, cap["sliding"]["kv_cache_spec_kind"], cap["sliding"]["kv_cache_spec_sliding_window"])
    }
    removed = [ev.data for ev in decoded if isinstance(ev.data, Removed)]
    assert [d.group for d in removed] == [0, 1, None]


def test_one_full_group_is_the_default_stream() -> None:
    # --kv-groups full names what --engine vllm sends without it: the same bytes
    cfg = WorkerConfig(tokens_per_block=TPB, device_blocks=8, host_blocks=8, engine="vllm")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # enough requests to push blocks to the host tier and out of it, one salted, one LoRA
    reqs = [
        Request(0, 0.0, 3 * TPB, 2, cache_salt="tenant-a", prompt=_prompt(1, 3 * TPB)),
        Request(1, 1.0, 2 * TPB + 5, 2, lora_id=3, prompt=_prompt(2, 2 * TPB + 5)),
    ]
    reqs += [Request(i, float(i), 3 * TPB, 2, prompt=_prompt(10 + i, 3 * TPB)) for i in range(2, 9)]
    frames: dict[str, list[bytes]] = {}
    try:
        for name, groups in (("default", None), ("full", parse_kv_groups("full"))):
            w = SimWorker(0, WorkerConfig(**{**_fields(cfg), "kv_groups": groups}), context=ctx)
            try:
                w.announce()
                for req in reqs:
                    record = RequestRecord(req.request_id, 0, req.arrival_ms, 0, 0)
                    w.enqueue(req, record, req.arrival_ms, req.tokens())
                    w.run_until(math.inf)
                frames[name] = [p for _, p, _, _ in w.take_frames()]
            finally:
                w.close()
    finally:
        ctx.term()
    media = {
        e["medium"]
        for p in frames["default"]
        for e in msgspec.msgpack.decode(p)[1]
        if "medium" in e
    }
    assert media == {"GPU", "CPU"}
    assert frames["full"] == frames["default"]


def _prompt(seed: int, n: int) -> array[int]:
    return array("i", [(seed * 7919 + i * 104729) % 50_000 + 1 for i in range(n)])


def _fields(cfg: WorkerConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in WorkerConfig.__dataclass_fields__}


def _run(kv_groups: str | None, event_buffer: int) -> tuple[Any, ...]:
    spec = SyntheticSpec()
    spec.num_requests = 60
    reqs = synthetic_workload("mixed", seed=3, spec=spec)
    cfg = SimConfig(
        workers=3,
        tokens_per_block=TPB,
        device_blocks=160,
        host_blocks=0,
        engine="vllm",
        kv_groups=None if kv_groups is None else parse_kv_groups(kv_groups),
        event_buffer=event_buffer,  # 2: overflows, repaired by snapshots sent in the dialect
    )
    sim = Simulation("kv_overlap", cfg)
    indexer = sim.router.indexer
    summary = sim.run(reqs)
    records = [(r.worker, r.predicted_overlap_blocks, r.reused_tokens) for r in summary.records]
    # per worker: whether the router holds each of its blocks in group 0 and in group 1
    held: list[tuple[bool, bool]] = []
    for w in sim.workers:
        assert w.events is not None
        snapshot = w.events.snapshot(w.manager.iter_blocks())
        assert snapshot is not None  # drained at the end of the run
        for ev in snapshot:
            assert isinstance(ev.data, Stored)
            for b in ev.data.blocks:
                h = w.dialect.engine_hash(b.block_hash)
                k0, k1 = indexer.key_of(w.worker_id, h), indexer.key_of(w.worker_id, h, 1)
                # a group's key of a block it never announced is (hash, group): not held
                held.append(
                    (
                        type(k0) is int and bool(indexer.holds(w.worker_id, k0)),
                        type(k1) is int and k1 != k0 and bool(indexer.holds(w.worker_id, k1)),
                    )
                )
    total = sum(indexer.block_count(w) for w in indexer.workers)
    # a tiny buffer really overflows (else its case would not exercise the snapshots)
    assert (summary.wire.overflowed_events > 0) == (event_buffer < 10)
    return records, summary.index_mismatch, indexer.anomalies, held, total, indexer.has_groups


@pytest.mark.parametrize("event_buffer", [1_000_000, 2])
@pytest.mark.parametrize("groups", ["full,sliding_window:64", "sliding_window:32,full,full"])
def test_a_hybrid_run_routes_as_one_group_and_indexes_every_group(
    groups: str, event_buffer: int
) -> None:
    one = _run(None, event_buffer)
    hybrid = _run(groups, event_buffer)
    records, mismatch, anomalies, held, total, has_groups = one
    assert mismatch == 0 and not any(anomalies.values()) and not has_groups
    assert held and all(g0 and not g1 for g0, g1 in held)
    assert sum(overlap for _, overlap, _ in records) > 0
    h_records, h_mismatch, h_anomalies, h_held, h_total, h_has_groups = hybrid
    assert h_records == records  # the same decisions, overlaps and reuse
    assert h_mismatch == 0 and not any(h_anomalies.values()), h_anomalies
    assert h_has_groups  # the groups' specs reached the router
    assert len(h_held) == len(held) and all(g0 and g1 for g0, g1 in h_held)
    n = len(groups.split(","))
    assert h_total == n * total  # no host tier: every block once per group


def _row(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("kv_overlap"))


def test_cli_hybrid_run_reports_the_one_group_figures(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--workload", "tenants", "--max-requests", "40", "--workers", "2"]
    argv += ["--policies", "kv_overlap", "--engine", "vllm", "--no-progress"]
    assert main(argv) == 0
    plain = _row(capsys.readouterr().out)
    assert main([*argv, "--kv-groups", "full,sliding_window:4096"]) == 0
    hybrid = _row(capsys.readouterr().out)
    assert float(plain.split()[1].rstrip("%")) > 0
    assert hybrid.split()[:3] == plain.split()[:3]  # policy, hit%, of bound


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--kv-groups", "full,sliding_window:64"], "--engine vllm"),
        (["--engine", "sglang", "--kv-groups", "full,sliding_window:64"], "--engine vllm"),
        (["--engine", "native", "--kv-groups", "full"], "--engine vllm"),
        (["--engine", "vllm", "--kv-groups", ""], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "full,,full"], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "sliding_window"], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "sliding_window:0"], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "sliding_window:-64"], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "sliding_window:4k"], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "full:16"], "--kv-groups"),
        (["--engine", "vllm", "--kv-groups", "mamba"], "--kv-groups"),
    ],
)
def test_cli_refuses_bad_kv_groups(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--workload", "tenants", "--max-requests", "5", "--no-progress", *extra]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and needle in captured.err, captured.err
    assert "kv_overlap" not in captured.out  # refused before any run


def test_configs_refuse_groups_of_another_engine() -> None:
    groups = parse_kv_groups("full,sliding_window:64")
    with pytest.raises(ValueError, match="vllm"):
        SimConfig(engine="sglang", kv_groups=groups)
    with pytest.raises(ValueError, match="vllm"):
        WorkerConfig(tokens_per_block=TPB, device_blocks=4, engine="native", kv_groups=groups)
    with pytest.raises(ValueError, match="vllm"):
        make_dialect("trtllm", 0, TPB, groups)
