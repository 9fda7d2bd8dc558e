"""The benchmark's results: what was measured per turn and per mode, and its summaries.

Everything here is measured or derived from measurements. A value nobody reported stays
`None` all the way to the report: a total over records that never carried it is `None`,
not 0, so that a missing counter can never pass for a measured zero.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

SCHEMA_VERSION = 1


class TurnRecord(BaseModel):
    """One turn of one session in one serving mode, as the runner measured it."""

    mode: str
    session_id: str
    turn: int = Field(ge=0, description="0-based turn index within the session.")
    prompt_tokens: int | None = None
    prefill_cached: int | None = None
    prefill_received: int | None = None
    prefill_computed: int | None = None
    prefill_reused: int | None = None
    decode_computed: int | None = Field(
        default=None, description="Prompt tokens the decode engine computed itself (turnkv's "
        "short deltas, served with no prefill request).")
    completion_tokens: int | None = None
    kv_to_decode_bytes: int | None = None
    kv_to_prefill_bytes: int | None = None
    ttft_ms: float | None = Field(default=None, description="At the client, from send.")
    prefill_phase_ms: float | None = Field(
        default=None, description="At the router: from accepting the turn to the end of its "
        "prefill request (P/D modes; None without a router).")
    router_ttft_ms: float | None = Field(
        default=None, description="At the router: from accepting the turn to the first token.")
    plan_ms: float | None = Field(
        default=None, description="At the router: how long it planned the turn (reading the "
        "prompt, asking the engines' loads); part of `router_ttft_ms`.")
    engine_prefill_ms: float | None = Field(
        default=None, description="The engine's own timing of the request that computed the "
        "prompt, from scheduling it to its first token (engines with per-request metrics).")
    itl_ms: list[float] = Field(default_factory=list, description="Gaps between output chunks.")
    e2e_ms: float | None = None
    fallback: str | None = None
    prefix_break_at: int | None = None
    placement: str | None = Field(
        default=None, description="Where the `turnkv` mode's planner ran the turn: whole, "
        "split or move (None: a mode that decides nothing per turn).")
    placement_why: str | None = Field(
        default=None, description="The planner's reason for the placement, with its "
        "estimates (`TurnPlacement.why`).")
    prefetch: str | None = Field(
        default=None, description="The prefetch before the turn, after a `next_turn_in` hint: "
        "in_time, awaited (the turn waited for it), early (called off); None: none.")
    prefill_node: str | None = Field(
        default=None, description="The engine that ran the turn's prefill request, as the "
        "router's stats name it (None: the decode engine served the turn alone).")
    decode_node: str | None = Field(
        default=None, description="The engine that decoded the turn (an aggregated engine: "
        "the one that served it; None without a router).")
    started_at: float = Field(description="Wall clock (Unix seconds) when the turn was sent.")
    ended_at: float | None = None
    error: str | None = None


class ModeStatus(BaseModel):
    """How a mode's run ended: `stalled` is a mode the runner stopped for making no progress."""

    state: Literal["ok", "stalled", "failed"]
    detail: str | None = None


class ModeRun(BaseModel):
    """Everything measured while one serving mode ran the workload (once: `--repeat N` gives a
    mode N runs)."""

    mode: str
    repeat: int = Field(default=0, ge=0, description="Which run of the mode, from 0: with "
                        "`--repeat N` the modes run interleaved, repeat 0 of each, then 1...")
    config: dict[str, Any] = Field(default_factory=dict)
    records: list[TurnRecord] = Field(default_factory=list)
    status: ModeStatus
    wall_s: float | None = None
    cpu_s: dict[str, float] = Field(
        default_factory=dict, description="CPU seconds per process: 'router', 'prefill-0', ..."
    )
    engine_counters: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Per engine, counter deltas over the run."
    )
    kv_cache_tokens: int | None = Field(default=None, description="Per engine, as vLLM sized it.")


class MachineInfo(BaseModel):
    """The host the benchmark ran on."""

    cpu_model: str
    cores: int
    os: str
    python: str

    @classmethod
    def detect(cls) -> MachineInfo:
        """Read the CPU model from /proc/cpuinfo where there is one, else from `platform`."""
        return cls(
            cpu_model=_cpu_model() or platform.processor() or platform.machine(),
            cores=os.cpu_count() or 0,
            os=platform.platform(),
            python=platform.python_version(),
        )


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


class WorkloadSummary(BaseModel):
    """Enough of the workload to tell runs apart; the workload itself is regenerated by seed."""

    name: str
    kind: str
    seed: int
    sessions: int
    turns: int
    concurrency: int | None = None


class Percentiles(BaseModel):
    """p50/p90/p99 of a sample; all `None` when the sample is empty."""

    n: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class TokenTotals(BaseModel):
    """Prompt tokens by source, summed; a source no record reported is `None`."""

    total: int | None = None
    cached: int | None = None
    received: int | None = None
    computed: int | None = None
    reused: int | None = None


class ModeSummary(BaseModel):
    """Aggregates of one run's records, over the turns that finished without error."""

    mode: str
    repeat: int = 0
    status: ModeStatus
    wall_s: float | None = None
    turns_ok: int
    errors: int
    fallbacks: int
    prefix_breaks: int
    ttft_ms: Percentiles
    ttft_ms_by_turn: dict[int, Percentiles]
    ttft_ms_later: Percentiles = Field(
        default_factory=Percentiles,
        description="TTFT of every turn after a session's first: the turns that can reuse KV.",
    )
    prefill_phase_ms: Percentiles = Field(default_factory=Percentiles)
    itl_ms: Percentiles
    decode_step_ms: float | None = Field(
        default=None, description="The median gap between output chunks at the client: the "
        "run's typical decode step as a client sees it.")
    itl_stall_share: float | None = Field(
        default=None, description="Share of the gaps between output chunks longer than "
        "`summary.STALL_FACTOR` (2) x `decode_step_ms`: decode steps that waited behind "
        "prompt work (a prefill or a delta computed in the same step) or for the cores.")
    e2e_ms: Percentiles
    output_tokens_per_s: float | None = Field(
        description="Over the mode's wall time; None for a stalled or failed mode, whose wall "
        "time includes the stall."
    )
    turns_per_s: float | None
    prompt_tokens: TokenTotals
    prefill_engine_tokens: TokenTotals | None = Field(
        default=None, description="The prefill (or single) engines' own `/metrics` account of "
        "their prompt tokens by source over the run, failed turns included; None without it."
    )
    engine_tokens: dict[str, TokenTotals] = Field(
        default_factory=dict, description="Every engine's own `/metrics` account of its "
        "prompt tokens (cached, received, computed; reused = cached + received), by engine.")
    all_engines_tokens: TokenTotals | None = Field(
        default=None, description="`engine_tokens` summed over the engines: all the work done "
        "(a prompt both engines handled counts on each); None without engine counters.")
    kv_to_decode_bytes: int | None
    kv_to_prefill_bytes: int | None
    kv_moved_bytes: int | None = Field(
        default=None, description="NIXL bytes the engines report moving over the run (each "
        "engine's `vllm:nixl_bytes_transferred`, or what each turnkv engine received, "
        "`turnkv:bytes_received`, summed); None where no engine exports either."
    )
    recompute_fraction: float | None = Field(
        description="Computed / prompt tokens, over turns that report both: the prefill "
        "engine's, plus the decode engine's for turns it served alone."
    )
    cpu_s: dict[str, float]


class Spread(BaseModel):
    """One figure over a mode's runs: the median of the runs' values and their range; `n` is
    how many runs reported it (all `None` when none did)."""

    n: int = 0
    median: float | None = None
    min: float | None = None
    max: float | None = None


class ModeAggregate(BaseModel):
    """A mode's runs combined: each figure's median over its finished runs, and its range.

    A mode none of whose runs finished is combined over all of them (partial numbers, marked
    by `status`)."""

    mode: str
    status: ModeStatus = Field(description="ok when every run was; else which ones were not.")
    runs: int
    runs_ok: int
    figures: dict[str, Spread] = Field(
        description="Headline figures by name (`aggregate.FIGURES`): ttft_p50, ttft_later_p50, "
        "itl_p99, itl_stall_share, output_tokens_per_s, ...")
    ttft_p50_by_turn: dict[int, Spread] = Field(default_factory=dict)
    ttft_p90_by_turn: dict[int, Spread] = Field(default_factory=dict)
    engine_tokens: dict[str, TokenTotals] = Field(
        default_factory=dict, description="Per engine, the median over the runs of each source.")
    all_engines_tokens: TokenTotals | None = None


class BenchResult(BaseModel):
    """The whole benchmark run: the JSON file `turnkv bench` writes."""

    schema_version: int = SCHEMA_VERSION
    created: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    machine: MachineInfo
    model: str
    workload: WorkloadSummary
    command: list[str]
    runs: list[ModeRun]
    baseline: str | None = None
    repeats: int = Field(default=1, description="Runs per mode (`--repeat`).")
    summaries: list[ModeSummary] = Field(
        default_factory=list, description="One per run, in the order of `runs`.")
    aggregates: list[ModeAggregate] = Field(
        default_factory=list, description="One per mode, in the order the modes first ran.")
    ratios: dict[str, dict[str, float | None]] = Field(
        default_factory=dict, description="mode -> metric -> the ratio of the mode's median to "
        "the baseline's.")
    ratio_spread: dict[str, dict[str, Spread]] = Field(
        default_factory=dict, description="mode -> metric -> the per-repeat ratios (repeat r of "
        "the mode over repeat r of the baseline): median, min, max.")
    later_ttft_p50_matrix: dict[str, dict[str, float | None]] = Field(
        default_factory=dict,
        description="row mode -> column mode -> row's median TTFT after the first turn / "
        "column's; None where either mode did not finish.",
    )
    later_ttft_p50_matrix_spread: dict[str, dict[str, Spread]] = Field(
        default_factory=dict, description="The same, per repeat: median, min, max.")


def percentiles(values: Sequence[float]) -> Percentiles:
    """p50/p90/p99 with numpy's default (linear) interpolation."""
    if not values:
        return Percentiles()
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return Percentiles(n=len(values), p50=float(p50), p90=float(p90), p99=float(p99))


def total(values: Iterable[int | None]) -> int | None:
    """Sum of the reported values; `None` when none was reported (never a guessed 0)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None
