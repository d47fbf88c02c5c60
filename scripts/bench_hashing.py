"""V1 event hashing throughput: native extension vs the pure-Python reference, one run.

Hashes a 4,096-token sequence at 32 tokens per block under a salted LoRA scope (the costliest
case: salt on the first block, LoRA on every block) and prints, side by side:

- native ``v1_chain`` on packed tokens (``kvcache.tokens.token_array``, as a router holds them);
- native ``v1_chain`` on a list of ints (includes validating and packing the list);
- native ``chain_hashes`` (the router-facing call) on packed tokens;
- the pure-Python reference of the tests (``tests/_reference.py``'s ``v1_chain``);
- tokens/s for each and the native/reference ratio, against the targets (>= 100M tokens/s,
  >= 50x).

Usage: ``python scripts/bench_hashing.py [--tokens 4096] [--tpb 32] [--seconds 1.0]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvcache.hashing import chain_hashes, v1_chain
from kvcache.scope import ReuseScope
from kvcache.tokens import token_array

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _reference import v1_chain as v1_chain_ref  # the tests' pure reference


def per_call(fn: Callable[[], object], seconds: float) -> float:
    """Median seconds per call over batches that together run about ``seconds``."""
    fn()  # warm up
    t0 = time.perf_counter()
    fn()
    single = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(0.02 / single))  # batches of ~20 ms keep timer noise out
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--tpb", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=1.0, help="per measured variant")
    args = parser.parse_args()

    tokens = [(i * 2654435761) % (1 << 31) for i in range(args.tokens)]
    packed = token_array(tokens)
    scope = ReuseScope(lora_id=7, salt=2**64 - 11)
    reference = v1_chain_ref(tokens, args.tpb, scope)
    if v1_chain(packed, args.tpb, scope) != reference:
        print("error: native and reference hashes differ", file=sys.stderr)
        return 1

    variants: list[tuple[str, Callable[[], object]]] = [
        ("v1_chain, packed tokens", lambda: v1_chain(packed, args.tpb, scope)),
        ("v1_chain, list of ints", lambda: v1_chain(tokens, args.tpb, scope)),
        ("chain_hashes, packed", lambda: chain_hashes(packed, args.tpb, scope)),
        ("v1_chain_ref (reference)", lambda: v1_chain_ref(tokens, args.tpb, scope)),
    ]
    print(f"{args.tokens} tokens, {args.tpb} tokens/block, scope {scope}")
    print(f"{'variant':<26}{'us/call':>12}{'Mtokens/s':>12}{'x reference':>13}")
    times = {name: per_call(fn, args.seconds) for name, fn in variants}
    ref = times["v1_chain_ref (reference)"]
    for name, t in times.items():
        print(f"{name:<26}{t * 1e6:>12.2f}{args.tokens / t / 1e6:>12.1f}{ref / t:>13.1f}")
    fast = times["v1_chain, packed tokens"]
    rate, ratio = args.tokens / fast, ref / fast
    print(
        f"fast path: {rate / 1e6:.0f}M tokens/s (target >= 100M: "
        f"{'met' if rate >= 100e6 else 'NOT met'}), {ratio:.0f}x the reference "
        f"(target >= 50x: {'met' if ratio >= 50 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
