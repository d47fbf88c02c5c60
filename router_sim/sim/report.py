"""The comparison report: a table on stdout, ``report.json``, ``report.csv`` and plots.

``report.json`` has the shape fixed by the architecture::

    {"workload": {..., "bound": float},            # token-weighted compulsory-miss bound
     "config": {...},
     "policies": {name: {"hit_rate": float, "ttft_p50_ms": ..., "ttft_p99_ms": ...,
                         "e2e_p50_ms": ..., "load_max_over_mean": ...,
                         "decision_us_p50": ..., ...}}}

Every figure is computed from simulated time and counts, except those named in
:data:`router_sim.sim.metrics.WALL_CLOCK_FIELDS` (routing decision time, run time, the ZeroMQ
transport's replay count): :func:`deterministic_view` removes them, and two runs with one seed
give identical views.
Plots need matplotlib (the ``plot`` extra); without it they are skipped with a note.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router_sim.sim.bound import BoundResult
from router_sim.sim.metrics import WALL_CLOCK_FIELDS, PolicySummary

Report = dict[str, Any]

_TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (field, header, format)
    ("hit_rate", "hit%", "{:.1%}"),
    ("of_bound", "of bound", "{:.1%}"),
    ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"),
    ("ttft_p99_ms", "p99", "{:.0f}"),
    ("e2e_p50_ms", "E2E p50", "{:.0f}"),
    ("e2e_p99_ms", "p99", "{:.0f}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("load_max_over_mean", "max/mean", "{:.2f}"),
    ("locality_given_up", "given up", "{:.1%}"),
    ("wire_events", "events", "{:d}"),
    ("wire_bytes", "MB wire", "{:.1f}"),
    ("gaps", "gaps", "{:d}"),
    ("recovered", "recov", "{:d}"),
    ("decision_us_p50", "dec us", "{:.0f}"),
)

_WIRE_COLUMNS: frozenset[str] = frozenset({"wire_events", "wire_bytes", "gaps", "recovered"})


def build_report(
    workload: Mapping[str, Any],
    bound: BoundResult,
    summaries: Mapping[str, PolicySummary],
    config: Mapping[str, Any],
) -> Report:
    """The report dictionary (see the module docstring)."""
    policies: dict[str, dict[str, Any]] = {}
    for name, summary in summaries.items():
        fields: dict[str, Any] = dict(summary.as_dict())
        fields["of_bound"] = (
            fields["hit_rate"] / bound.token_hit_rate if bound.token_hit_rate > 0 else 0.0
        )
        policies[name] = fields
    return {
        "workload": {
            **workload,
            "bound": bound.token_hit_rate,
            "bound_blocks": bound.block_hit_rate,
            "prompt_tokens": bound.total_tokens,
            "prompt_blocks": bound.total_blocks,
        },
        "config": dict(config),
        "policies": policies,
        "wall_clock_fields": list(WALL_CLOCK_FIELDS),
    }


def deterministic_view(report: Report) -> Report:
    """A copy of ``report`` without the wall-clock fields (for determinism comparisons)."""
    out = json.loads(json.dumps(report))
    for fields in out["policies"].values():
        for name in WALL_CLOCK_FIELDS:
            fields.pop(name, None)
    return out  # type: ignore[no-any-return]


def format_table(report: Report) -> str:
    """A plain-text comparison table, one row per policy."""
    wl = report["workload"]
    head = (
        f"workload {wl.get('name', '?')}: {wl.get('requests', 0)} requests, "
        f"{wl.get('prompt_tokens', 0)} prompt tokens; compulsory-miss bound "
        f"{wl['bound']:.1%} of tokens ({wl.get('bound_blocks', 0.0):.1%} of blocks)"
    )
    engine = report.get("config", {}).get("engine")
    if engine is not None:
        head += f"; workers speak {engine}"
    headers = ["policy"] + [h for _, h, _ in _TABLE_COLUMNS]
    rows: list[list[str]] = []
    for name, fields in report["policies"].items():
        row = [name]
        for key, _, fmt in _TABLE_COLUMNS:
            value = fields.get(key, 0)
            if (key in _WIRE_COLUMNS and fields.get("events") is False) or value is None:
                row.append("-")  # no event stream in this run (or no bytes written): not measured
                continue
            if key == "wire_bytes":
                value = value / 1e6
            row.append(fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    parts = [head, line(headers), line(["-" * w for w in widths]), *map(line, rows)]
    return "\n".join(parts)


def _scalar_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if isinstance(v, (int, float, str))}


def write_json(report: Report, path: Path) -> None:
    """Standard JSON (RFC 8259 has no NaN or Infinity): a non-finite number is written as null."""
    text = json.dumps(_finite(report), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_csv(report: Report, path: Path) -> None:
    """One row per policy, scalar fields only, with the workload's bound on every row."""
    rows = [
        {"policy": name, "bound": report["workload"]["bound"], **_scalar_fields(fields)}
        for name, fields in report["policies"].items()
    ]
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_plots(
    report: Report, summaries: Mapping[str, PolicySummary], out_dir: Path
) -> list[Path]:
    """hit_rate.png, ttft_cdf.png and load_per_worker.png; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = list(report["policies"])
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(8, 4))
    rates = [report["policies"][n]["hit_rate"] * 100 for n in names]
    ax.bar(names, rates, color="tab:blue")
    ax.axhline(report["workload"]["bound"] * 100, color="tab:red", linestyle="--", label="bound")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title("Hit rate per policy vs the compulsory-miss bound")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    written.append(out_dir / "hit_rate.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in names:
        ttft = sorted(summaries[name].ttft_ms())
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.plot(ttft, ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, simulated)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(out_dir / "ttft_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        per_worker = report["policies"][name]["requests_per_worker"]
        xs = [w + i * width for w in range(len(per_worker))]
        ax.bar(xs, per_worker, width=width, label=name)
    ax.set_xlabel("worker")
    ax.set_ylabel("requests routed")
    ax.set_title("Load per worker")
    ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(out_dir / "load_per_worker.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def write_outputs(
    report: Report, summaries: Mapping[str, PolicySummary], out_dir: Path
) -> list[Path]:
    """report.json, report.csv, report.txt (the table) and the plots, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(report, out_dir / "report.json")
    write_csv(report, out_dir / "report.csv")
    (out_dir / "report.txt").write_text(format_table(report) + "\n", encoding="utf-8")
    paths = [out_dir / "report.json", out_dir / "report.csv", out_dir / "report.txt"]
    return paths + write_plots(report, summaries, out_dir)
