"""Record golden KV-event captures from the engines' own released code (run by hand, never in CI).

For each engine version this script downloads the released wheel (``pip download --no-deps``)
into a scratch directory, extracts only the module that defines the KV-event structs and the
ZeroMQ publisher (vLLM: ``vllm/distributed/kv_events.py``; SGLang:
``sglang/srt/disaggregation/kv_events.py`` plus the event recorder
``sglang/srt/mem_cache/events.py``), and imports it with only the engine-internal imports
stubbed (logging, config dataclasses, network helpers and, for SGLang, the page hash helpers;
no engine code is copied). It then drives the engine's own event classes and its own
``ZmqEventPublisher`` through a realistic stream, receives every batch on a SUB socket, asks the
publisher's replay socket for the whole stream with a DEALER, and writes:

- ``stream.jsonl``: the frames as received (``kv-events listen --record`` capture format), live
  messages first, then the replay reply (``replay: true``, frames as the DEALER got them);
- ``expected.json``: what the stream implies, from the scenario (not from this project's
  decoder): per (tier, group) the engine hashes a worker holds at the end, and the prompts
  (token ids, LoRA, salt) whose leading blocks a router must find on that worker;
- ``README.md``: version, wheel, and how each file was made.

Engine block hashes are opaque to a router (vLLM: sha256 of CBOR with a process seed, or
xxhash; SGLang: a sha256 chain namespaced by adapter and salt). vLLM's hashing lives in
``kv_cache_utils`` with the whole engine behind it, so the vLLM captures carry stand-in hashes
with the same shape: the top 64 bits of a sha256 chain over the block's tokens (ints, about half
>= 2**63), or the raw 32-/16-byte digest where vLLM publishes bin hashes. SGLang's recorder
turns its own page hashes into event hashes (signed int64, namespaced by LoRA and salt); the
page hashes it starts from are a sha256 chain over the page tokens, as SGLang's are.

Run from the repository root:  python scripts/record_engine_captures.py [--only vllm-0.33.0]
Needs network access, ``msgspec`` and ``pyzmq``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

import zmq

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "engines"
VLLM_VERSIONS = ("0.11.0", "0.25.1", "0.26.0", "0.33.0")
SGLANG_VERSIONS = ("0.5.23",)
BLOCK = 16


# ----------------------------------------------------------------------------- loading


def fetch_wheel(engine: str, version: str, scratch: Path) -> Path:
    dest = scratch / f"{engine}-{version}"
    dest.mkdir(parents=True, exist_ok=True)
    found = list(dest.glob("*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                f"{engine}=={version}",
                "-d",
                str(dest),
            ],
            check=True,
        )
        found = list(dest.glob("*.whl"))
    return found[0]


def module_from_wheel(wheel: Path, member: str, name: str) -> types.ModuleType:
    """Import ``member`` of ``wheel`` as module ``name`` (its source is read, never kept)."""
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(member).decode("utf-8")
    spec = importlib.util.spec_from_loader(name, loader=None, origin=f"{wheel.name}!{member}")
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"{wheel.name}!{member}"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def stub(name: str, **attrs: Any) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def clear_modules(prefix: str) -> None:
    for key in [k for k in sys.modules if k == prefix or k.startswith(prefix + ".")]:
        del sys.modules[key]


class _Config:
    """Stand-in for the engines' KVEventsConfig (a plain record of its keyword arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host, port


def load_vllm(wheel: Path) -> types.ModuleType:
    clear_modules("vllm")
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.config.kv_events", KVEventsConfig=_Config)
    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda host, port: f"tcp://{host}:{port}",
        is_valid_ipv6_address=lambda host: ":" in host,
        split_zmq_path=_split_zmq_path,
    )
    # vLLM: ExternalBlockHash = bytes | int (kv_cache_utils), the union its events accept.
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return module_from_wheel(wheel, "vllm/distributed/kv_events.py", "vllm.distributed.kv_events")


class _NetworkAddress:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    @classmethod
    def parse(cls, text: str) -> _NetworkAddress:
        host, _, port = text.rpartition(":")
        return cls(host, int(port))

    def to_tcp(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def _sha_chain(tokens: list[int], prior: str | None, page: int) -> list[str]:
    """Page hashes as a sha256 chain (hex): each page's digest covers the previous digest and
    the page's token ids as 4-byte little-endian ints."""
    out: list[str] = []
    for start in range(0, len(tokens), page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[start : start + page]:
            h.update(int(t).to_bytes(4, "little"))
        prior = h.hexdigest()
        out.append(prior)
    return out


def _key_tokens(key: Any) -> list[Any]:
    raw = list(key.token_ids)
    return [(raw[i], raw[i + 1]) for i in range(len(raw) - 1)] if key.is_bigram else raw


def _node_hashes(node: Any, page: int) -> list[str]:
    parent = node.parent
    prior = parent.hash_value[-1] if parent is not None and parent.hash_value else None
    flat = [
        t for item in _key_tokens(node.key) for t in (item if isinstance(item, tuple) else (item,))
    ]
    return _sha_chain(flat, prior, page if not node.key.is_bigram else 2 * page)


def _node_event_hashes(node: Any, page: int) -> list[str]:
    if node.event_hash_value is None:
        salt = node.key.cache_salt
        prior = hashlib.sha256(salt.encode()).hexdigest() if salt else None
        parent = node.parent
        if parent is not None and parent.event_hash_value:
            prior = parent.event_hash_value[-1]
        node.event_hash_value = _sha_chain(list(node.key.token_ids), prior, page)
    return list(node.event_hash_value)


def _hash_str_to_int64(text: str) -> int:
    # SGLang: the first 16 hex characters as a signed 64-bit int (mem_cache/utils.py).
    value = int(text[:16], 16)
    return value - 2**64 if value >= 2**63 else value


def load_sglang(wheel: Path) -> tuple[types.ModuleType, types.ModuleType]:
    clear_modules("sglang")
    stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    stub("sglang.srt.utils.network", NetworkAddress=_NetworkAddress)
    stub(
        "sglang.srt.mem_cache.utils",
        compute_node_hash_values=_node_hashes,
        compute_node_event_hash_values=_node_event_hashes,
        hash_str_to_int64=_hash_str_to_int64,
    )
    kv = module_from_wheel(
        wheel, "sglang/srt/disaggregation/kv_events.py", "sglang.srt.disaggregation.kv_events"
    )
    rec = module_from_wheel(wheel, "sglang/srt/mem_cache/events.py", "sglang.srt.mem_cache.events")
    return kv, rec


# ----------------------------------------------------------------------------- recording


def record(
    publisher_cls: type, batches: list[Any], workdir: Path, **kw: Any
) -> list[dict[str, Any]]:
    """Publish ``batches`` through the engine's publisher; return the received messages."""
    ctx = zmq.Context.instance()
    pub_ep, replay_ep = f"ipc://{workdir}/pub", f"ipc://{workdir}/replay"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = publisher_cls(0, endpoint=pub_ep, replay_endpoint=replay_ep, **kw)
    sub.connect(pub_ep)
    time.sleep(0.5)  # a PUB drops what it sends before the SUB has joined (script, not test)
    messages: list[dict[str, Any]] = []
    for batch in batches:
        publisher.publish(batch)
    deadline = time.monotonic() + 10
    while len(messages) < len(batches) and time.monotonic() < deadline:
        if sub.poll(200):
            messages.append({"worker": 0, "replay": False, "frames": sub.recv_multipart()})
    if len(messages) != len(batches):
        raise RuntimeError(f"received {len(messages)} of {len(batches)} batches")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not dealer.poll(200):
            continue
        frames = dealer.recv_multipart()
        messages.append({"worker": 0, "replay": True, "frames": frames})
        if b"\xff" * 8 in frames:
            break
    else:
        raise RuntimeError("no end marker from the replay socket")
    publisher.shutdown()
    sub.close(0)
    dealer.close(0)
    return messages


def write_capture(path: Path, messages: list[dict[str, Any]], endpoint: str) -> None:
    header = {"format": "kv-events-capture", "version": 1, "endpoints": [endpoint]}
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for i, m in enumerate(messages):
            frames = [base64.b64encode(fr).decode("ascii") for fr in m["frames"]]
            line = {"i": i, "worker": m["worker"], "replay": m["replay"], "frames": frames}
            f.write(json.dumps(line) + "\n")


# ----------------------------------------------------------------------------- vLLM


def toks(seed: int, n: int) -> list[int]:
    """Deterministic token ids in [0, 151936) (a real vocabulary size)."""
    out, x = [], seed * 2654435761 % 2**32
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(x % 151936)
    return out


def vllm_hashes(tokens: list[int], parent: bytes, tag: str, *, size: int = 8) -> list[bytes]:
    """Stand-in engine hashes: a sha256 chain over (parent digest, tag, block tokens)."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        h = hashlib.sha256(parent + tag.encode())
        for t in tokens[start : start + BLOCK]:
            h.update(t.to_bytes(4, "little"))
        parent = h.digest()
        out.append(parent if size == 32 else parent[:size])
    return out


def as_int(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def vllm_stream(
    mod: types.ModuleType, version: str, bin_size: int | None
) -> tuple[list[Any], dict[str, Any]]:
    """The scenario; returns the batches and what they imply."""
    fields = set(mod.BlockStored.__struct_fields__)
    removed_fields = set(mod.BlockRemoved.__struct_fields__)
    conv = (lambda d: d) if bin_size else as_int
    size = bin_size or 8

    def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
        args: dict[str, Any] = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": kw.pop("block_size", BLOCK),
            "lora_id": kw.pop("lora_id", None),
            "medium": kw.pop("medium", "GPU"),
        }
        if "lora_name" in fields:
            args["lora_name"] = kw.pop("lora_name", None)
        kw.pop("lora_name", None)
        args.update({k: v for k, v in kw.items() if k in fields})
        return mod.BlockStored(**args)

    def removed(hashes: list[Any], medium: str | None = "GPU", **kw: Any) -> Any:
        return mod.BlockRemoved(
            block_hashes=hashes,
            medium=medium,
            **{k: v for k, v in kw.items() if k in removed_fields},
        )

    grouped = "group_idx" in fields
    g0 = {"group_idx": 0} if grouped else {}
    ta = toks(1, 6 * BLOCK)
    a = [conv(d) for d in vllm_hashes(ta, b"", "", size=size)]
    tl = toks(2, 2 * BLOCK)
    lora = [conv(d) for d in vllm_hashes(tl, b"", "adapter-a", size=size)]
    ts_ = toks(3, 2 * BLOCK)
    salt = [conv(d) for d in vllm_hashes(ts_, b"", "tenant-a", size=size)]
    td = toks(4, 3 * BLOCK + 5)
    d = [conv(x) for x in vllm_hashes(td, b"\x01", "", size=size)]
    ev: list[list[Any]] = []
    ev.append(
        [
            stored(a[:4], None, ta[: 4 * BLOCK], **g0),
            stored(
                lora,
                None,
                tl,
                lora_id=1,
                lora_name="adapter-a",
                extra_keys=[("adapter-a",), ("adapter-a",)],
                **g0,
            ),
        ]
    )
    ev.append(
        [
            stored(a[4:6], a[3], ta[4 * BLOCK :], **g0),
            stored(salt, None, ts_, extra_keys=[("tenant-a",), None], **g0),
        ]
    )
    cpu_placeholder_size = 16 if version == "0.11.0" else 0
    third: list[Any] = []
    if grouped:
        # Sliding-window group 1: blocks 0-1 fall outside the window (null, left out of the
        # hashes) while token_ids still cover all four blocks; the hashes are the group's own
        # copies of blocks 2-3.
        third.append(
            stored(
                a[2:4],
                None,
                ta[: 4 * BLOCK],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=2 * BLOCK,
            )
        )
    # CPU offload: placeholder stores (no token ids) from the offloading connector.
    third.append(stored(a[:2], None, [], block_size=cpu_placeholder_size, medium="CPU"))
    expect_cpu = [a[0], a[1]]
    if version == "0.33.0":
        # offload chunks: block a1 announced once per chunk (two chunks hold it)
        third.append(stored([a[1]], None, [], block_size=0, medium="CPU"))
    ev.append(third)
    fourth = [removed(a[4:6], "GPU", **g0)]
    if grouped:
        fourth.append(removed([a[3]], "GPU", group_idx=1))
    if version == "0.33.0":
        fourth.append(removed([a[1]], "CPU"))  # one chunk of two released: a1 stays on CPU
    extra_tier = {"0.26.0": "FS", "0.33.0": "STORAGE"}.get(version)
    if extra_tier:
        fourth.append(stored([a[0]], None, [], block_size=0, medium=extra_tier))
    ev.append(fourth)
    ev.append([mod.AllBlocksCleared()])
    last = [stored(d[:3], None, td[: 3 * BLOCK], **g0)]
    if version == "0.33.0":
        # 0.33 announces a trailing partial block: its block_size is its token count
        last.append(
            stored(
                [conv(hashlib.sha256(b"partial").digest()[:size])],
                d[2],
                td[3 * BLOCK :],
                block_size=5,
                **g0,
            )
        )
    ev.append(last)
    batches = [mod.KVEventBatch(ts=1_700_000_000.0 + i, events=e) for i, e in enumerate(ev)]

    def show(h: Any) -> Any:
        return h.hex() if isinstance(h, bytes) else h

    held: dict[str, list[Any]] = {
        "CPU/0": [show(h) for h in expect_cpu],
        "GPU/0": [show(h) for h in d[:3]],
    }
    if version == "0.33.0":
        held["GPU/0"].append(show(batches[-1].events[-1].block_hashes[0]))
    if extra_tier:
        held[f"{extra_tier}/0"] = [show(a[0])]
    old = version == "0.11.0"
    lora_ref = {"lora_id": 1, "lora_name": None} if old else {"lora_name": "adapter-a"}
    salted = 0 if old else 2
    expected = {
        "block_size": BLOCK,
        "held": held,
        "routes": [
            {"tokens": td[: 3 * BLOCK], "lora_name": None, "salt": None, "blocks": 3},
            # the clear reset the GPU cache only: blocks 0-1 are still on the CPU tier
            {"tokens": ta[: 3 * BLOCK], "lora_name": None, "salt": None, "blocks": 2},
        ],
        "before_clear_routes": [
            {"tokens": ta, "lora_name": None, "salt": None, "blocks": 6, "after_batch": 1},
            # 0.11 names the adapter by lora_id only and does not publish the salt
            {"tokens": tl, **lora_ref, "salt": None, "blocks": 2, "after_batch": 1},
            {
                "tokens": ts_,
                "lora_name": None,
                "salt": "tenant-a",
                "blocks": salted,
                "after_batch": 1,
            },
            {
                "tokens": ts_,
                "lora_name": None,
                "salt": None,
                "blocks": 2 - salted,
                "after_batch": 1,
            },
            {"tokens": tl, "lora_name": None, "salt": None, "blocks": 0, "after_batch": 1},
        ],
        "batches": len(batches),
        "events": sum(len(e) for e in ev),
        "clears": 1,
    }
    if grouped:
        expected["hybrid"] = {
            "why": (
                "vLLM's hybrid rule (HybridKVCacheCoordinator / SlidingWindowManager."
                "find_longest_cache_hit) once group 1's store names it a sliding window of 32 "
                "tokens: a hit needs cdiv(31, 16) = 2 blocks of group 1 ending it (scanning "
                "from its end), else group 1's run from the first block"
            ),
            "window_blocks": 2,
            "routes": [
                # after batch 2: group 0 holds a0..a5, group 1 a2 and a3: the hit ends at a3
                {
                    "tokens": ta,
                    "lora_name": None,
                    "salt": None,
                    "after_batch": 2,
                    "blocks": 4,
                    "limited_by": 1,
                },
                # after batch 3: group 0 holds a0..a3, group 1 a2 alone: no run of 2, and
                # group 1 holds no block from the first
                {
                    "tokens": ta,
                    "lora_name": None,
                    "salt": None,
                    "after_batch": 3,
                    "blocks": 0,
                    "limited_by": 1,
                },
            ],
            # at the end group 1 holds nothing (the clear reset every group's device tier)
            "final_routes": [
                {
                    "tokens": td[: 3 * BLOCK],
                    "lora_name": None,
                    "salt": None,
                    "blocks": 0,
                    "limited_by": 1,
                },
                {
                    "tokens": ta[: 3 * BLOCK],
                    "lora_name": None,
                    "salt": None,
                    "blocks": 0,
                    "limited_by": 1,
                },
            ],
        }
    return batches, expected


# ----------------------------------------------------------------------------- SGLang


class _Key:
    def __init__(
        self,
        token_ids: list[int],
        extra_key: str | None = None,
        cache_salt: str | None = None,
        is_bigram: bool = False,
    ) -> None:
        self.token_ids, self.extra_key, self.cache_salt, self.is_bigram = (
            token_ids,
            extra_key,
            cache_salt,
            is_bigram,
        )

    def __len__(self) -> int:
        return max(0, len(self.token_ids) - 1) if self.is_bigram else len(self.token_ids)


class _Node:
    def __init__(self, key: _Key, parent: _Node | None) -> None:
        self.key, self.parent = key, parent
        self.hash_value: list[str] | None = None
        self.event_hash_value: list[str] | None = None


def sglang_stream(kv: types.ModuleType, rec: types.ModuleType) -> tuple[list[Any], dict[str, Any]]:
    names = rec.KvEventLoraNames()
    lora_key = "x" * 8 + "a" * 32  # SGLang's extra_key ends with the 32-character adapter id
    names.register(types.SimpleNamespace(extra_key=lora_key, lora_id="a" * 32), "adapter-a")
    recorder = rec.KVCacheEventRecorder(enabled=True, page_size=BLOCK, lora_names=names)
    root = _Node(_Key([]), None)
    root.hash_value = []
    t1, t2 = toks(11, 2 * BLOCK), toks(12, BLOCK + 4)
    n1 = _Node(_Key(t1), root)
    n2 = _Node(_Key(t2), n1)
    nl = _Node(_Key(toks(13, 2 * BLOCK), extra_key=lora_key), root)
    ns = _Node(_Key(toks(14, 2 * BLOCK), cache_salt="tenant-a"), root)
    tb = toks(15, 2 * BLOCK + 1)  # bigram view: 32 bigrams over 33 raw tokens
    nb = _Node(_Key(tb, is_bigram=True), root)
    batches: list[list[Any]] = []
    recorder.record_store(n1)
    recorder.record_store(n2)
    recorder.record_store(nl)
    batches.append(recorder.take())
    recorder.record_store(ns)
    recorder.record_store(n1, medium=kv.StorageMedium.CPU)  # write-back to host
    batches.append(recorder.take())
    recorder.record_remove(n2)
    recorder.record_store(nb)
    batches.append(recorder.take())
    recorder.record_all_cleared()
    batches.append(recorder.take())
    t3 = toks(16, 3 * BLOCK)
    n3 = _Node(_Key(t3), root)
    recorder.record_store(n3)
    batches.append(recorder.take())
    out = [kv.KVEventBatch(ts=1_700_000_000.0 + i, events=e) for i, e in enumerate(batches)]
    n1_hashes = [_hash_str_to_int64(h) for h in n1.hash_value or []]
    n3_hashes = [_hash_str_to_int64(h) for h in n3.hash_value or []]
    expected = {
        "block_size": BLOCK,
        "held": {"GPU/0": n3_hashes},
        "held_if_clear_keeps_host": {"CPU_PINNED/0": n1_hashes},
        "routes": [{"tokens": t3, "lora_name": None, "salt": None, "blocks": 3}],
        "before_clear_routes": [
            {"tokens": t1 + t2, "lora_name": None, "salt": None, "blocks": 3, "after_batch": 0},
            {"tokens": t1 + t2, "lora_name": None, "salt": None, "blocks": 2, "after_batch": 2},
            {
                "tokens": nl.key.token_ids,
                "lora_name": "adapter-a",
                "salt": None,
                "blocks": 2,
                "after_batch": 0,
            },
            {
                "tokens": nl.key.token_ids,
                "lora_name": None,
                "salt": None,
                "blocks": 0,
                "after_batch": 0,
            },
            {
                "tokens": ns.key.token_ids,
                "lora_name": None,
                "salt": "tenant-a",
                "blocks": 2,
                "after_batch": 1,
            },
        ],
        "batches": len(out),
        "events": sum(len(b) for b in batches),
        "clears": 1,
    }
    return out, expected


# ----------------------------------------------------------------------------- decoder rules


def decoder_rules(mod: types.ModuleType) -> dict[str, Any]:
    """The engine's event structs as its msgspec decoder reads them: per event tag, whether it
    is positional, its fields in order with whether each is required, and whether unknown
    fields are refused."""
    import msgspec  # the engines' own dependency; this script's only use of it

    out: dict[str, Any] = {}
    for cls in (mod.BlockStored, mod.BlockRemoved, mod.AllBlocksCleared):
        info = msgspec.inspect.type_info(cls)
        out[str(info.tag)] = {
            "array_like": info.array_like,
            "forbid_unknown_fields": info.forbid_unknown_fields,
            "fields": [[f.encode_name, f.required] for f in info.fields],
        }
    return out


def project_payloads() -> dict[str, bytes]:
    """What this project's encoder writes for a representative batch: a salted LoRA chain, a
    tier move (as the default sends it), a removal, a clear, a capacity announcement."""
    sys.path.insert(0, str(OUT.parent.parent.parent))
    from events.wire.codec import encode_batch
    from events.wire.model import (
        AllBlocksCleared,
        Created,
        EventDiff,
        KVCacheEvent,
        Removed,
        Stored,
        StoredBlock,
        Updated,
    )

    blocks = [StoredBlock(2**64 - 1 - i, list(range(i, i + BLOCK)), 3, 0, 35, 7) for i in range(2)]
    events = [
        KVCacheEvent(0, Created([100, 200])),
        KVCacheEvent(1, Stored(None, blocks, BLOCK)),
        KVCacheEvent(2, Updated(2**64 - 1, cache_level=EventDiff(0, 1))),
        KVCacheEvent(3, Removed([2**64 - 2], 0)),
        KVCacheEvent(4, AllBlocksCleared()),
    ]
    return {
        "map": encode_batch(events, 1.0, 0),
        "positional": encode_batch(events, 1.0, 0, form="positional"),
        "map+extensions": encode_batch(events, 1.0, 0, extensions=True),
    }


def engine_decodes(mod: types.ModuleType, payloads: dict[str, bytes]) -> dict[str, str]:
    """Whether the engine's own decoder (msgspec, its KVEventBatch) reads each payload."""
    import msgspec

    result: dict[str, str] = {}
    for form, payload in payloads.items():
        try:
            batch = msgspec.msgpack.decode(payload, type=mod.KVEventBatch)
            result[form] = f"ok: {len(batch.events)} events"
        except Exception as exc:
            result[form] = f"rejected: {exc}"
    return result


# ----------------------------------------------------------------------------- main

README = """# {name}

Recorded by `scripts/record_engine_captures.py` (run by hand; tests never download) from
`{wheel}`: the script imported `{module}` from the wheel with only engine-internal imports
stubbed{stubs}, built the event batches of the scenario below with the engine's own event
classes, published them through the engine's own `ZmqEventPublisher` (PUB + ROUTER replay on
`ipc://` endpoints), and recorded what a SUB and a DEALER received.

- `stream.jsonl`: capture format of `events.tools.capture` (`kv-events listen --record`): the
  {n} live messages `[topic, seq, payload]` as a SUB received them.
- `replay_raw.jsonl`: same format, the publisher's reply to a DEALER request for seq 0
  (`replay: true`), frames exactly as the DEALER received them (leading empty delimiter
  frame, with or without the topic frame as this version sends it, end marker included).
- `expected.json`: the state the scenario implies, written by the script from the scenario
  itself: `held` = engine hashes the worker holds at the end per `MEDIUM/group`;
  `routes` = prompts and how many leading blocks a router must find on this worker at the end;
  `before_clear_routes` = the same after batch `after_batch`.

Scenario: {scenario}

Hashes: {hashes}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="one NAME such as vllm-0.33.0")
    ap.add_argument("--scratch", default=tempfile.gettempdir() + "/engine-wheels")
    args = ap.parse_args()
    scratch = Path(args.scratch)
    jobs = [("vllm", v, None) for v in VLLM_VERSIONS] + [
        ("vllm", "0.33.0", 32),
        ("vllm", "0.26.0", 16),
    ]
    jobs += [("sglang", v, None) for v in SGLANG_VERSIONS]
    rules_path = OUT / "decoder_rules.json"
    rules: dict[str, Any] = json.loads(rules_path.read_text()) if rules_path.exists() else {}
    payloads = project_payloads()
    for engine, version, bin_size in jobs:
        name = f"{engine}-{version}" + (f"-bin{bin_size}" if bin_size else "")
        if args.only and args.only != name:
            continue
        wheel = fetch_wheel(engine, version, scratch)
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as work:
            if engine == "vllm":
                mod = load_vllm(wheel)
                if not bin_size:
                    rules[name] = {
                        "events": decoder_rules(mod),
                        "this_project_encoder": engine_decodes(mod, payloads),
                    }
                batches, expected = vllm_stream(mod, version, bin_size)
                messages = record(mod.ZmqEventPublisher, batches, Path(work))
                module = "vllm/distributed/kv_events.py"
                stubs = (
                    " (`vllm.logger`, `vllm.config.kv_events`, "
                    "`vllm.utils.network_utils`, `vllm.v1.core.kv_cache_utils.ExternalBlockHash`)"
                )
                scenario = (
                    "a 6-block chain sent as 4 + 2 blocks (the second store names its parent), a "
                    "LoRA chain (`lora_id` 1, `lora_name` adapter-a where the version has it, "
                    "`extra_keys` naming it), a salted chain "
                    "(`extra_keys` [(tenant-a,), None]: the "
                    "salt on the first block), where the version has groups a sliding-window store "
                    "in group 1 whose token_ids cover 4 blocks but whose hashes name only the 2 "
                    "in the window, CPU-offload placeholder stores (no token ids; block_size 16 "
                    "on 0.11, 0 later; 0.33 announces one block once per offload chunk), GPU "
                    "removals (and on grouped versions a group-1 removal of a hash group 0 still "
                    "holds; on 0.33 one CPU chunk release), a store on a third tier (FS on "
                    "0.26, STORAGE on 0.33), AllBlocksCleared (resets the GPU prefix cache "
                    "only), then a 3-block chain (0.33: plus a trailing 5-token partial block)."
                )
                hashes = (
                    f"{bin_size}-byte bin hashes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"
                    if bin_size
                    else "64-bit ints, about half >= 2**63"
                ) + (
                    "; stand-ins for vLLM's (opaque to a router): a "
                    "sha256 chain over the block tokens."
                )
            else:
                kv, rec = load_sglang(wheel)
                rules[name] = {
                    "events": decoder_rules(kv),
                    "this_project_encoder": engine_decodes(kv, payloads),
                }
                batches, expected = sglang_stream(kv, rec)
                messages = record(kv.ZmqEventPublisher, batches, Path(work))
                module = (
                    "sglang/srt/disaggregation/kv_events.py` and `sglang/srt/mem_cache/events.py"
                )
                stubs = (
                    " (`sglang.srt.runtime_context`, `sglang.srt.utils.network`, and the "
                    "page hash helpers of `sglang.srt.mem_cache.utils`)"
                )
                scenario = (
                    "SGLang's own `KVCacheEventRecorder` (page size 16) driven with radix nodes: "
                    "a 2-page node, its child of 20 tokens (one full page coalesced into the "
                    "parent's store, the 4-token partial page as its own store with block_size 4), "
                    "a LoRA node (extra_key ending in a registered adapter id, lora_name "
                    "adapter-a, namespaced hashes), a salted node (`cache_salt` tenant-a), a "
                    "write-back of the first node to `CPU_PINNED`, the removal of the child, "
                    "an EAGLE bigram node (token_ids as pairs), "
                    "AllBlocksCleared, then a 3-page node."
                )
                hashes = (
                    "signed int64 event hashes made by SGLang's "
                    "recorder from sha256 page-hash chains."
                )
            live = [m for m in messages if not m["replay"]]
            write_capture(out / "stream.jsonl", live, "ipc://pub")
            replies = [m for m in messages if m["replay"]]
            write_capture(out / "replay_raw.jsonl", replies, "ipc://replay")
            (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
            (out / "README.md").write_text(
                README.format(
                    name=name,
                    wheel=wheel.name,
                    module=module,
                    stubs=stubs,
                    n=len(batches),
                    scenario=scenario,
                    hashes=hashes,
                )
            )
        print(f"{name}: {len(messages)} messages")
    rules_path.write_text(json.dumps(rules, indent=1, sort_keys=True) + "\n")
    for name, rule in sorted(rules.items()):
        print(name, rule["this_project_encoder"])


if __name__ == "__main__":
    main()
