"""A sweep's results as a table, ``sweep.json``, ``sweep.csv`` and plots.

The plots put load on the x axis (the speed-up or request rate when the sweep varies it, else
the fleet size) with one line per policy, and one panel per combination of the other axes that
vary, so that "which policy holds its hit rate and TTFT as load grows" reads off one picture.
Plots need matplotlib (the ``plot`` extra); without it they are skipped.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Any, Final

from router_sim.sweep.runner import ROW_METRICS

AXES: Final[tuple[str, ...]] = (
    "policy",
    "workers",
    "device_blocks",
    "speedup",
    "rate_per_s",
    "event_delay_ms",
    "seed",
)


def varying(rows: list[dict[str, Any]]) -> list[str]:
    """The grid axes that take more than one value in ``rows``."""
    return [a for a in AXES if len({r.get(a) for r in rows}) > 1]


def x_axis(rows: list[dict[str, Any]]) -> str:
    """The axis the plots put on x: load if it varies, else the fleet size, else blocks."""
    moving = varying(rows)
    for name in ("speedup", "rate_per_s", "workers", "device_blocks", "event_delay_ms"):
        if name in moving:
            return name
    return "speedup" if "speedup" in rows[0] else "rate_per_s"


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per point: the axes that vary, hit rate (and bound), TTFT, E2E, balance."""
    shown = [a for a in varying(rows) if a != "policy"]
    head = ["policy", *shown, "hit%", "bound%", "TTFT p50", "p99", "E2E p99", "max/mean", "wall s"]
    lines = [head]
    for r in rows:
        lines.append(
            [
                str(r["policy"]),
                *(f"{r[a]:g}" for a in shown),
                f"{100 * r['hit_rate']:.1f}",
                f"{100 * r['bound']:.1f}",
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
                f"{r['e2e_p99_ms']:.0f}",
                f"{r['load_max_over_mean']:.2f}",
                f"{r['wall_s']:.1f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_results(
    rows: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any] | None = None
) -> list[Path]:
    """``sweep.json`` (meta + rows), ``sweep.csv`` and the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "sweep.json"
    js.write_text(json.dumps({"meta": meta or {}, "rows": rows}, indent=2) + "\n")
    cols = [a for a in AXES if any(a in r for r in rows)] + ["bound", *ROW_METRICS]
    path_csv = out_dir / "sweep.csv"
    with path_csv.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    title = str((meta or {}).get("workload", "sweep"))
    return [js, path_csv, *plot(rows, out_dir, title=title)]


def _panels(rows: list[dict[str, Any]], x: str) -> list[tuple[str, list[dict[str, Any]]]]:
    others = [a for a in varying(rows) if a not in ("policy", x)]
    if not others:
        return [("", rows)]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(a) for a in others), []).append(r)
    return [
        (", ".join(f"{a}={v:g}" for a, v in zip(others, key, strict=True)), group)
        for key, group in groups.items()
    ]


def plot(
    rows: list[dict[str, Any]], out_dir: Path, name: str = "sweep.png", title: str = "sweep"
) -> list[Path]:
    """Hit rate and TTFT p99 against load, one line per policy; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    x = x_axis(rows)
    panels = _panels(rows, x)[:6]
    fig, axes = plt.subplots(
        2, len(panels), figsize=(4.8 * len(panels), 7.5), squeeze=False, sharex="col"
    )
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for col, (panel, group) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        for policy, marker in zip(policies, itertools.cycle("os^vDP*X"), strict=False):
            pts = sorted((r[x], r) for r in group if r["policy"] == policy)
            xs = [p[0] for p in pts]
            top.plot(xs, [100 * p[1]["hit_rate"] for p in pts], marker=marker, label=policy)
            bottom.plot(xs, [p[1]["ttft_p99_ms"] for p in pts], marker=marker, label=policy)
        bounds = sorted({(r[x], r["bound"]) for r in group})
        top.plot([b[0] for b in bounds], [100 * b[1] for b in bounds], "k--", lw=1, label="bound")
        top.set_title(f"{title}: {panel}" if panel else title, fontsize=10)
        top.set_ylabel("prefix hit rate (% of prompt tokens)")
        bottom.set_ylabel("TTFT p99 (ms)")
        bottom.set_yscale("log")
        bottom.set_xlabel(x.replace("_", " "))
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
