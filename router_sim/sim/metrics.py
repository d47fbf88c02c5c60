"""Per-request records of a simulation and the per-policy summary computed from them.

Every figure here is a function of simulated time and counts, so two runs with one seed give
identical summaries; the few that depend on the host's timing (routing decision time, run
time, the transport's replay count) are listed in :data:`WALL_CLOCK_FIELDS` so that
determinism checks can leave them out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TypedDict

WALL_CLOCK_FIELDS: Final[tuple[str, ...]] = (
    "decision_us_p50",
    "decision_us_p99",
    "decision_us_mean",
    "wall_s",
    "replayed",
)
"""Summary fields that depend on the host's timing: they differ between identical runs. The
wall-clock ones, and ``replayed`` (batches received through replays over ZeroMQ: a replay
re-sends batches after the gap too, and how many of those had already come live depends on
when the subscriber saw the gap; ``recovered`` counts the lost ones alone, deterministically)."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in simulated ms)."""

    request_id: int
    worker: int
    arrival_ms: float
    input_length: int
    output_length: int
    reused_tokens: int = 0
    """Prompt tokens served from cache at the request's first admission."""
    first_token_ms: float | None = None
    finish_ms: float | None = None
    best_overlap_tokens: int = 0
    """Largest prefix (tokens, whole blocks) any worker truly held when the router decided."""
    chosen_overlap_tokens: int = 0
    """Prefix (tokens, whole blocks) the chosen worker truly held at that moment."""
    predicted_overlap_blocks: int = 0
    """Blocks of overlap the router's index credited the chosen worker with."""
    preemptions: int = 0
    decision_us: float = 0.0


@dataclass(slots=True)
class WireStats:
    """Event traffic between the workers and the router, summed over workers."""

    batches: int = 0
    events: int = 0
    bytes: int | None = 0
    """What the ZeroMQ transports sent (topic, seq and payload of each frame); None with the
    memory transport, which hands the router the batches without writing them."""
    dropped_frames: int = 0
    """Live frames removed by fault injection."""
    gaps: int = 0
    replayed: int = 0
    """Batches received through replays (timing-dependent, see WALL_CLOCK_FIELDS)."""
    recovered: int = 0
    """Batches lost live that a replay delivered."""
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0
    overflowed_events: int = 0
    """Events the workers' bounded event buffers dropped."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def _ratio_max_mean(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


class SummaryFields(TypedDict):
    """The report fields of one policy's run (:meth:`PolicySummary.as_dict`), each typed."""

    requests: int
    completed: int
    hit_rate: float
    prompt_tokens: int
    reused_tokens: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    e2e_p99_ms: float
    throughput_tok_s: float
    throughput_req_s: float
    makespan_s: float
    load_max_over_mean: float
    busy_max_over_mean: float
    requests_per_worker: list[int]
    busy_ms_per_worker: list[float]
    locality_given_up: float
    decisions_off_best: int
    preemptions: int
    wire_batches: int
    wire_events: int
    wire_bytes: int | None
    dropped_frames: int
    gaps: int
    replayed: int
    recovered: int
    resyncs: int
    restarts: int
    decode_errors: int
    overflowed_events: int
    index_mismatch_blocks: int
    events: bool
    decision_us_p50: float
    decision_us_p99: float
    decision_us_mean: float
    wall_s: float


@dataclass(slots=True)
class PolicySummary:
    """The figures of one policy's run (see :meth:`as_dict` for the report fields)."""

    records: list[RequestRecord]
    workers: int
    busy_ms: list[float]
    wire: WireStats = field(default_factory=WireStats)
    index_mismatch: int = 0
    """Blocks the router's index got wrong once every event arrived (0: it recovered; -1:
    not measured)."""
    wall_s: float = 0.0
    events: bool = True
    """Whether the run had the event stream (False: the wire figures are zeros, not
    measured; see ``SimConfig.events``)."""

    def as_dict(self) -> SummaryFields:
        """Report fields; hit rates are token-weighted fractions in [0, 1]."""
        done = [r for r in self.records if r.finish_ms is not None]
        ttft = [r.first_token_ms - r.arrival_ms for r in done if r.first_token_ms is not None]
        e2e = [r.finish_ms - r.arrival_ms for r in done if r.finish_ms is not None]
        prompt = sum(r.input_length for r in self.records)
        reused = sum(r.reused_tokens for r in self.records)
        per_worker = [0] * self.workers
        for r in self.records:
            per_worker[r.worker] += 1
        start = min((r.arrival_ms for r in self.records), default=0.0)
        end = max((r.finish_ms for r in done if r.finish_ms is not None), default=start)
        span_s = max(end - start, 1e-9) / 1000.0
        out_tokens = sum(r.output_length for r in done)
        given_up = sum(r.best_overlap_tokens - r.chosen_overlap_tokens for r in self.records)
        decisions = [r.decision_us for r in self.records]
        w = self.wire
        return {
            "requests": len(self.records),
            "completed": len(done),
            "hit_rate": reused / prompt if prompt else 0.0,
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p90_ms": percentile(ttft, 90),
            "ttft_p99_ms": percentile(ttft, 99),
            "e2e_p50_ms": percentile(e2e, 50),
            "e2e_p90_ms": percentile(e2e, 90),
            "e2e_p99_ms": percentile(e2e, 99),
            "throughput_tok_s": out_tokens / span_s,
            "throughput_req_s": len(done) / span_s,
            "makespan_s": span_s,
            "load_max_over_mean": _ratio_max_mean([float(x) for x in per_worker]),
            "busy_max_over_mean": _ratio_max_mean(self.busy_ms),
            "requests_per_worker": per_worker,
            "busy_ms_per_worker": [round(x, 3) for x in self.busy_ms],
            "locality_given_up": given_up / prompt if prompt else 0.0,
            "decisions_off_best": sum(
                1 for r in self.records if r.chosen_overlap_tokens < r.best_overlap_tokens
            ),
            "preemptions": sum(r.preemptions for r in self.records),
            "wire_batches": w.batches,
            "wire_events": w.events,
            "wire_bytes": w.bytes,
            "dropped_frames": w.dropped_frames,
            "gaps": w.gaps,
            "replayed": w.replayed,
            "recovered": w.recovered,
            "resyncs": w.resyncs,
            "restarts": w.restarts,
            "decode_errors": w.decode_errors,
            "overflowed_events": w.overflowed_events,
            "index_mismatch_blocks": self.index_mismatch,
            "events": self.events,
            "decision_us_p50": percentile(decisions, 50),
            "decision_us_p99": percentile(decisions, 99),
            "decision_us_mean": sum(decisions) / len(decisions) if decisions else 0.0,
            "wall_s": self.wall_s,
        }

    def ttft_ms(self) -> list[float]:
        """TTFT of every completed request, in request order (for CDF plots)."""
        return [
            r.first_token_ms - r.arrival_ms for r in self.records if r.first_token_ms is not None
        ]
