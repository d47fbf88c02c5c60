"""Capacity answers: the smallest fleet per policy that meets a TTFT p99 target.

A plan is a sweep over fleet sizes (every other axis fixed); for each policy the answer is the
smallest size whose run completes every request with TTFT p99 at or under the target, given
together with the curve behind it (TTFT p99 and hit rate per size), since a curve that crosses
the target once and comes back above it deserves a look before anyone buys hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router_sim.sweep.runner import SweepResult


@dataclass(slots=True)
class PolicyPlan:
    """One policy's answer: ``workers`` is None when no size tried meets the target."""

    policy: str
    workers: int | None
    curve: list[dict[str, Any]]
    """The rows of this policy, by fleet size."""
    monotone: bool
    """Every size above the answer meets the target too."""


def meets(row: dict[str, Any], ttft_p99_ms: float) -> bool:
    """Whether a run meets the target: all requests served, TTFT p99 at or under it."""
    return bool(row["completed"] == row["requests"] and row["ttft_p99_ms"] <= ttft_p99_ms)


def answer(result: SweepResult, ttft_p99_ms: float) -> list[PolicyPlan]:
    """Per policy (in sweep order), the smallest fleet meeting ``ttft_p99_ms``."""
    plans = []
    for policy in dict.fromkeys(r["policy"] for r in result.rows):
        curve = sorted(
            (r for r in result.rows if r["policy"] == policy), key=lambda r: r["workers"]
        )
        ok = [meets(r, ttft_p99_ms) for r in curve]
        first = next((i for i, good in enumerate(ok) if good), None)
        plans.append(
            PolicyPlan(
                policy=policy,
                workers=None if first is None else curve[first]["workers"],
                curve=curve,
                monotone=first is None or all(ok[first:]),
            )
        )
    return plans


def format_plan(plans: list[PolicyPlan], ttft_p99_ms: float) -> str:
    """The answers, then each policy's curve."""
    lines = [f"smallest fleet with TTFT p99 <= {ttft_p99_ms:g} ms:"]
    for p in plans:
        if p.workers is None:
            tried = max(r["workers"] for r in p.curve)
            lines.append(f"  {p.policy:<16} none up to {tried} workers")
        else:
            note = "" if p.monotone else "  (a larger fleet misses it again: check the curve)"
            lines.append(f"  {p.policy:<16} {p.workers} workers{note}")
    lines.append("")
    lines.append(f"{'policy':<16}{'workers':>8}{'TTFT p99':>10}{'p50':>8}{'hit %':>7}{'meets':>7}")
    for p in plans:
        for r in p.curve:
            lines.append(
                f"{p.policy:<16}{r['workers']:>8}{r['ttft_p99_ms']:>10.0f}"
                f"{r['ttft_p50_ms']:>8.0f}{100 * r['hit_rate']:>7.1f}"
                f"{'yes' if meets(r, ttft_p99_ms) else 'no':>7}"
            )
    return "\n".join(lines)


def plot_plan(plans: list[PolicyPlan], ttft_p99_ms: float, out_dir: Path) -> list[Path]:
    """``plan.png``: TTFT p99 against fleet size per policy, the target as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for p in plans:
        xs = [r["workers"] for r in p.curve]
        label = p.policy + (f" -> {p.workers}" if p.workers is not None else " -> none")
        ax.plot(xs, [r["ttft_p99_ms"] for r in p.curve], marker="o", label=label)
    ax.axhline(ttft_p99_ms, color="k", ls="--", lw=1, label=f"target {ttft_p99_ms:g} ms")
    ax.set_xlabel("workers")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "plan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
