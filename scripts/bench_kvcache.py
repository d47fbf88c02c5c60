"""Per-block cost of the cache manager's hot paths against a bare hash-chain baseline.

Prints, from one run, side by side:

- baseline: ``sha256(parent + tokens as bytes).digest()`` + one dict lookup, per block;
- match: ``create_kv_cache`` on a fully cached prompt (every block reused), per block;
- commit: ``commit`` of a whole prompt into a fresh sequence, per block;
- metadata bytes per cached block (tracemalloc), with the 1 KiB target.

Usage: ``python scripts/bench_kvcache.py [--blocks 128] [--tpb 32] [--repeat 30]``.

``--against DIR`` instead replays the bundled Mooncake conversation trace through the cache the
way ``router_sim``'s workers drive it (``create_kv_cache`` on the prompt, ``resize``, prefill
chunks, one ``commit`` per 512-token block of decode, ``stop_committing``, ``close``, preemption
when pages run out) with a small device tier, so eviction runs all the time. The replay runs in
subprocesses, alternately with the ``kvcache`` of this tree and the one under ``DIR`` (a checkout
of an older commit, e.g. ``git worktree add /tmp/kv_base HEAD``), and prints the time per call
of each operation for both, their ratio, and whether both made the same calls with the same
outcome (every event the sink heard, every reuse, every out-of-pages).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from array import array
from collections import deque
from collections.abc import Sequence
from hashlib import sha256
from pathlib import Path
from typing import Any

from kvcache import KVCacheManager, KVCacheManagerConfig, OutOfPagesError, TierConfig

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "router_sim" / "data" / "conversation_trace.jsonl.gz"
OPS = ("create_kv_cache", "resize", "commit", "stop_committing", "close")


def _prompt(seed: int, n: int) -> array[int]:
    # Distinct per seed from the first token on, so prompts share nothing.
    return array("i", [(seed * 1_000_003 + i * 7919) % 100_000 for i in range(n)])


def baseline(prompt: array[int], tpb: int, repeat: int) -> float:
    data = prompt.tobytes()
    step = 4 * tpb
    nblocks = len(prompt) // tpb
    table: dict[bytes, int] = {}
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        parent = b"\x00" * 32
        for start in range(0, nblocks * step, step):
            parent = sha256(parent + data[start : start + step]).digest()
            table.get(parent)
        samples.append((time.perf_counter() - t0) / nblocks)
    return statistics.median(samples)


def match(manager: KVCacheManager, prompt: array[int], tpb: int, repeat: int) -> float:
    seq = manager.create_kv_cache(prompt)
    seq.commit(prompt)
    seq.close()
    query = array("i", prompt)
    query.append(1)  # one token past the cached prefix: every full block is reusable
    nblocks = len(prompt) // tpb
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        seq = manager.create_kv_cache(query)
        samples.append((time.perf_counter() - t0) / nblocks)
        assert seq.num_reused_tokens == len(prompt)
        seq.close()
    return statistics.median(samples)


def commit(manager: KVCacheManager, tpb: int, nblocks: int, repeat: int) -> float:
    samples = []
    for r in range(repeat):
        prompt = _prompt(10_000 + r, nblocks * tpb)
        seq = manager.create_kv_cache(prompt)
        t0 = time.perf_counter()
        seq.commit(prompt)
        samples.append((time.perf_counter() - t0) / nblocks)
        seq.close()
        manager.clear_reusable_blocks()
    return statistics.median(samples)


def memory_per_block(tpb: int, nblocks: int, prompts: int) -> float:
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb, tiers=[TierConfig(name="device", num_blocks=nblocks * prompts + 8)]
    )
    data = [_prompt(50_000 + i, nblocks * tpb) for i in range(prompts)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    manager = KVCacheManager(cfg)
    for prompt in data:
        with manager.create_kv_cache(prompt) as seq:
            seq.commit(prompt)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert manager.num_cached_blocks == nblocks * prompts
    return (after - before) / manager.num_cached_blocks


# ------------------------------------------------------------------ trace replay, side by side


class _Log:
    """An event sink that keeps what each call said (read during the call), for the check that
    two implementations behaved the same; cheap enough not to hide the cache's own cost."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def on_stored(self, blocks: Sequence[Any]) -> None:
        self.calls.append(("s", [(b.key, b.tier, b.priority, len(b.tokens)) for b in blocks]))

    def on_removed(self, blocks: Sequence[Any]) -> None:
        self.calls.append(("r", [b.key for b in blocks]))

    def on_moved(self, blocks: Sequence[Any], old_tier: int, new_tier: int) -> None:
        self.calls.append(("m", old_tier, new_tier, [b.key for b in blocks]))

    def on_cleared(self) -> None:
        self.calls.append(("c",))


class _Seq:
    __slots__ = ("cache", "full", "generated", "in_cache", "inp", "order", "out", "target")

    def __init__(self, full: array[int], inp: int, out: int, order: int) -> None:
        self.full, self.inp, self.out, self.order = full, inp, out, order
        self.cache: Any = None
        self.generated = self.in_cache = self.target = 0


def _trace_prompts(limit: int, tpb: int) -> list[tuple[array[int], int, int]]:
    """The first ``limit`` requests of the bundled trace as (prompt + answer tokens, input
    length, output length): hash id ``h`` stands for tokens ``h * tpb ...`` (distinct ids give
    distinct blocks, as the trace means), each answer is a run of its own above 2**30."""
    out: list[tuple[array[int], int, int]] = []
    with gzip.open(TRACE, "rt") as f:
        for rid, line in enumerate(f):
            if rid >= limit:
                break
            row = json.loads(line)
            inp, n_out = row["input_length"], row["output_length"]
            full = array("i")
            for h in row["hash_ids"]:
                full.extend(range(h * tpb, h * tpb + tpb))
            del full[inp:]
            base = (1 << 30) + (rid * 4099) % ((1 << 30) - n_out)
            full.extend(range(base, base + n_out))
            out.append((full, inp, n_out))
    return out


def replay(requests: int, device_blocks: int, host_blocks: int, max_running: int) -> dict[str, Any]:
    """Drive one cache like a simulated worker (router_sim.sim.worker): FIFO admission while the
    prompt fits, prefill in chunks of 8192 tokens per step, decode one block per step, newest
    request preempted when pages run out. Returns time and calls per operation and a digest of
    everything observable."""
    tpb = 512
    import kvcache

    prompts = _trace_prompts(requests, tpb)
    tiers = [TierConfig(name="device", num_blocks=device_blocks)]
    if host_blocks:
        tiers.append(TierConfig(name="host", num_blocks=host_blocks))
    sink = _Log()
    manager = KVCacheManager(KVCacheManagerConfig(tokens_per_block=tpb, tiers=tiers), sink)
    ns = dict.fromkeys(OPS, 0)
    calls = dict.fromkeys(OPS, 0)
    outcomes: list[Any] = []
    # CPU time of this thread: other processes sharing the machine do not inflate it
    clock = time.thread_time_ns
    waiting = deque(_Seq(full, inp, n_out, i) for i, (full, inp, n_out) in enumerate(prompts))
    running: list[_Seq] = []

    def timed(op: str, fn: Any, *args: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args)
        finally:
            ns[op] += clock() - t0
            calls[op] += 1

    def admit(s: _Seq) -> bool:
        target = s.inp + s.generated
        try:
            cache = timed("create_kv_cache", manager.create_kv_cache, s.full[:target])
        except OutOfPagesError:
            outcomes.append(("oop-create", s.order))
            return False
        try:
            timed("resize", cache.resize, target + 1)
        except OutOfPagesError:
            outcomes.append(("oop-resize", s.order))
            timed("close", cache.close)
            return False
        outcomes.append(("reuse", s.order, cache.num_reused_tokens))
        s.cache, s.target, s.in_cache = cache, target, cache.num_reused_tokens
        return True

    def commit(s: _Seq, upto: int) -> None:
        if upto > s.in_cache:
            timed("commit", s.cache.commit, s.full[s.in_cache : upto])
            s.in_cache = upto

    def preempt_for(needy: _Seq) -> bool:
        victim = max(running, key=lambda r: r.order)
        running.remove(victim)
        timed("close", victim.cache.close)
        victim.cache = None
        victim.in_cache = 0
        waiting.appendleft(victim)
        outcomes.append(("preempt", victim.order))
        return victim is not needy

    t_start = clock()
    while waiting or running:
        while waiting and len(running) < max_running and admit(waiting[0]):
            running.append(waiting.popleft())
        if not running:
            raise SystemExit("replay: a request cannot be admitted on an empty device tier")
        budget = 8192
        for s in sorted(running, key=lambda r: r.order):
            if s not in running:
                continue  # preempted by an earlier one this step
            if s.in_cache < s.target:  # prefill
                if budget <= 0:
                    continue
                upto = min(s.target, s.in_cache + budget)
                budget -= upto - s.in_cache
                commit(s, upto)
                if upto < s.target:
                    continue
                s.generated = max(s.generated, 1)
            else:  # decode up to the next block boundary or the end
                pos = s.inp + s.generated
                s.generated = min(s.out, (pos // tpb + 1) * tpb - s.inp)
            pos = s.inp + s.generated
            if s.generated >= s.out:
                commit(s, s.inp + s.out)
                timed("stop_committing", s.cache.stop_committing)
                timed("close", s.cache.close)
                running.remove(s)
                continue
            ok = True
            while ok and s.cache.capacity < pos + 1:
                try:
                    timed("resize", s.cache.resize, -(-(pos + 1) // tpb) * tpb)
                except OutOfPagesError:
                    ok = preempt_for(s)
            if ok:
                commit(s, pos - pos % tpb)
    wall_ns = clock() - t_start
    st = manager.stats
    digest = sha256(repr((sink.calls, outcomes, st.evictions, st.drops)).encode()).hexdigest()
    return {
        "kvcache": str(Path(kvcache.__file__).resolve().parent),
        "ns": ns,
        "calls": calls,
        "wall_ns": wall_ns,
        "digest": digest,
        "events": len(sink.calls),
        "evictions": st.evictions,
        "hit_rate": st.hit_rate,
        "preemptions": sum(1 for o in outcomes if o[0] == "preempt"),
    }


def against(base_root: str, args: argparse.Namespace) -> None:
    """Replay in subprocesses, alternating this tree's kvcache and ``base_root``'s."""
    here = str(ROOT)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--replay-json",
        f"--requests={args.requests}",
        f"--device-blocks={args.device_blocks}",
        f"--host-blocks={args.host_blocks}",
        f"--max-running={args.max_running}",
    ]
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    for _ in range(args.rounds):
        for name, root in (("base", base_root), ("this", here)):
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout)
            if Path(res["kvcache"]) != Path(root, "kvcache").resolve():
                raise SystemExit(f"{name}: imported kvcache from {res['kvcache']}, not {root}")
            runs[name].append(res)
    b0, t0 = runs["base"][0], runs["this"][0]
    print(
        f"trace replay: {args.requests} requests, device {args.device_blocks} blocks, host "
        f"{args.host_blocks}, max running {args.max_running}, 512 tokens/block; "
        f"{args.rounds} alternating rounds, medians"
    )
    print(f"base: {base_root}/kvcache   this: {here}/kvcache")
    print("CPU time per call (thread time), and the ratio base / this")
    print(f"{'operation':<16}{'calls':>8}{'base us/call':>14}{'this us/call':>14}{'speed-up':>10}")
    for op in (*OPS, "total"):
        if op == "total":
            b = statistics.median(sum(r["ns"].values()) for r in runs["base"])
            t = statistics.median(sum(r["ns"].values()) for r in runs["this"])
            n = sum(t0["calls"].values())
        else:
            b = statistics.median(r["ns"][op] for r in runs["base"])
            t = statistics.median(r["ns"][op] for r in runs["this"])
            n = t0["calls"][op]
        print(f"{op:<16}{n:>8}{b / n / 1e3:>14.2f}{t / n / 1e3:>14.2f}{b / t:>9.2f}x")
    bw = statistics.median(r["wall_ns"] for r in runs["base"]) / 1e9
    tw = statistics.median(r["wall_ns"] for r in runs["this"]) / 1e9
    print(f"replay CPU (cache calls + driver): base {bw:.2f} s, this {tw:.2f} s, {bw / tw:.2f}x")
    same = {r["digest"] for r in runs["base"] + runs["this"]}
    print(
        f"events {t0['events']}, evictions {t0['evictions']}, preemptions {t0['preemptions']}, "
        f"hit rate {t0['hit_rate']:.2%}; "
        f"same calls, outcomes and events: {'yes' if len(same) == 1 else 'NO'}"
    )
    if len(same) != 1 or b0["calls"] != t0["calls"]:
        raise SystemExit("the two implementations behaved differently")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="DIR", help="replay side by side with DIR's kvcache")
    ap.add_argument("--replay-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=1500, help="replay: trace requests")
    ap.add_argument("--device-blocks", type=int, default=6000, help="replay: device tier")
    ap.add_argument("--host-blocks", type=int, default=0, help="replay: host tier")
    ap.add_argument("--max-running", type=int, default=64, help="replay: running requests")
    ap.add_argument("--rounds", type=int, default=3, help="replay: alternating rounds")
    ap.add_argument("--blocks", type=int, default=128, help="blocks per prompt")
    ap.add_argument("--tpb", type=int, default=32, help="tokens per block")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--memory-prompts", type=int, default=50)
    args = ap.parse_args()
    if args.replay_json:
        res = replay(args.requests, args.device_blocks, args.host_blocks, args.max_running)
        print(json.dumps(res))
        return
    if args.against:
        against(args.against, args)
        return
    tpb, nblocks = args.tpb, args.blocks
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb, tiers=[TierConfig(name="device", num_blocks=4 * nblocks)]
    )
    manager = KVCacheManager(cfg)
    prompt = _prompt(1, nblocks * tpb)
    base = baseline(prompt, tpb, args.repeat)
    m = match(manager, prompt, tpb, args.repeat)
    c = commit(manager, tpb, nblocks, args.repeat)
    mem = memory_per_block(tpb, nblocks, args.memory_prompts)
    print(f"tokens_per_block={tpb} blocks_per_prompt={nblocks} repeat={args.repeat} (medians)")
    print(f"{'path':<10}{'us/block':>10}{'x baseline':>12}{'target':>10}")
    print(f"{'baseline':<10}{base * 1e6:>10.3f}{1.0:>12.2f}{'':>10}")
    print(f"{'match':<10}{m * 1e6:>10.3f}{m / base:>12.2f}{'<= 2x':>10}")
    print(f"{'commit':<10}{c * 1e6:>10.3f}{c / base:>12.2f}{'<= 4x':>10}")
    print(f"metadata bytes per cached block: {mem:.0f} (target <= 1024)")


if __name__ == "__main__":
    main()
