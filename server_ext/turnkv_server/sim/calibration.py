"""The cost model fitted from `turnkv bench` results (its results.json), by least squares.

- prefill: turns that ran alone (no other turn of the run in flight on their engine, where
  the records name it or the run's counters tell each session's, else on any, from their
  start to their first token), their time to the first token (P/D modes: the prefill
  phase) against the tokens they computed and the keys those attend to
  (`ServiceCosts.prefill_ms`), from the runs on engines of the simulated engines' cores
  (`on_simulated_engines`);
- decode: each turn's median gap between output tokens against the turns decoding beside it
  (those in flight during its decode, per decoding engine);
- each routing's own work per turn: how much longer its modes' turns that ran alone took than
  the prefill curve says, above the routing that took least (`fit_prefill_and_overheads`);
- transfer: `standard` turns, the time from the prefill's end to the first token less one
  decode step, against the prompt's tokens (the whole prompt's KV moves);
- the wait of a prompt that reaches an engine decoding other turns (`fit_join_wait`), on
  engines without and with a host tier;
- a host tier's store, per block, on the engine that copies it (`fit_store_cost`): how much
  longer a turn's first decode steps took, where its prompt's new blocks were stored, than
  on engines without a tier;
- the tier reads at the transfer rate (both are copies between memory regions of the same
  host here: no bench turn times a tier read on its own);
- the KV cache: the runs' own size (`kv_cache_tokens`), the block size the runs' configured
  one, else the largest that divides every prefix hit and vLLM's CPU block, the bytes per
  token the configured cache's bytes over its tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

import numpy as np

from turnkv_server.bench.cli import VLLM_CPU_BLOCK_TOKENS
from turnkv_server.sim.bench_modes import BENCH_ROUTINGS
from turnkv_server.sim.bench_tiers import tier_tokens
from turnkv_server.sim.bench_workloads import bench_homes
from turnkv_server.sim.service_costs import ServiceCosts, attended_keys

_P_D = ("standard", "standard-nocache", "bidirectional", "push")


def load_results(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if "runs" not in result:
        raise ValueError(f"{path} is not a turnkv bench results.json (no runs)")
    return result


def _computed(record: Mapping[str, Any]) -> int | None:
    parts = [record.get("prefill_computed"), record.get("decode_computed")]
    found = [p for p in parts if p is not None]
    return sum(found) if found else None


def _prefill_ms(record: Mapping[str, Any], mode: str) -> float | None:
    if mode in _P_D or record.get("prefill_phase_ms"):
        return record.get("prefill_phase_ms") or None
    return record.get("ttft_ms")


def _alone(record: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> bool:
    start = record["started_at"]
    first = start + (record.get("ttft_ms") or 0) / 1000
    return not any(o is not record and o["started_at"] < first and o["ended_at"] > start
                   for o in others)


def _ok(run: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in run["records"] if r.get("error") is None and r.get("ttft_ms")]


def _beside(run: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """The turns of the run that could have slowed a turn's prefill: those on the engine that
    computed it, where the records name their engines (`prefill_node`, else `decode_node`:
    a turn is on both of its engines) or the run's counters tell each session's
    (`bench_homes`: pooled engines, one core each); else all of them."""
    records = _ok(run)
    if records and all(r.get("prefill_node") or r.get("decode_node") for r in records):
        on: dict[str, list[Mapping[str, Any]]] = {}
        for r in records:
            for engine in {str(n) for n in (r.get("prefill_node"), r.get("decode_node")) if n}:
                on.setdefault(engine, []).append(r)
        return lambda r: on[r.get("prefill_node") or r["decode_node"]]
    homes = bench_homes(run)
    if not homes:
        return lambda _: records
    by_engine: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        by_engine.setdefault(homes[r["session_id"]], []).append(r)
    return lambda r: by_engine[homes[r["session_id"]]]


class AloneTurn(NamedTuple):
    """A turn that ran alone (`_alone`), as the prefill fit reads it."""

    routing: str | None  # its mode's simulated routing (`bench_modes`), if it has one
    computed: int
    prompt: int
    ms: float  # its time to the first token (P/D modes: the prefill phase)


# A routing's overhead is a median of its turns that ran alone: of fewer than this many it
# would be one or two turns' noise (a stall, a failed receive), not the routing's own work.
MIN_OVERHEAD_TURNS = 5


def alone_turns(runs: Iterable[Mapping[str, Any]]) -> list[AloneTurn]:
    out = []
    for run in runs:
        beside = _beside(run)
        for r in _ok(run):
            n, ms = _computed(r), _prefill_ms(r, run["mode"])
            if n and ms and n >= 16 and _alone(r, beside(r)):
                out.append(AloneTurn(BENCH_ROUTINGS.get(run["mode"]), n, r["prompt_tokens"], ms))
    return out


def _fit_curve(turns: Sequence[AloneTurn], overheads: Mapping[str, float]
               ) -> tuple[float, float, float]:
    rows = [[1.0, t.computed, attended_keys(t.computed, t.prompt) / 1000] for t in turns]
    ys = [t.ms - overheads.get(t.routing or "", 0.0) for t in turns]
    coef = _nonnegative_lstsq(np.asarray(rows), np.asarray(ys))
    return float(coef[0]), float(coef[1]), float(coef[2])


def _curve_ms(curve: tuple[float, float, float], turn: AloneTurn) -> float:
    fixed, per_token, per_kctx = curve
    return fixed + turn.computed * per_token + per_kctx * attended_keys(
        turn.computed, turn.prompt) / 1000


def fit_prefill_and_overheads(runs: Iterable[Mapping[str, Any]]
                              ) -> tuple[tuple[float, float, float], dict[str, float]]:
    """The prefill curve `(fixed ms, ms per token, ms per 1k keys attended)` and
    each routing's own work per turn in ms (`ServiceCosts.routing_overhead_ms`).

    A routing's overhead is how much more its turns that ran alone took than the curve
    fitted across every mode's says (the median of the differences), above the routing that
    took least; the curve is then refitted to every turn less its routing's overhead, so that
    it is the engines' cost. Routings with fewer than `MIN_OVERHEAD_TURNS` such turns get
    none."""
    turns = alone_turns(runs)
    if len(turns) < 3:
        raise ValueError("too few turns that ran alone to fit a prefill cost")
    curve = _fit_curve(turns, {})
    by_routing: dict[str, list[float]] = {}
    for t in turns:
        if t.routing is not None:
            by_routing.setdefault(t.routing, []).append(t.ms - _curve_ms(curve, t))
    above = {routing: median(left) for routing, left in by_routing.items()
             if len(left) >= MIN_OVERHEAD_TURNS}
    if not above:
        return curve, {}
    least = min(above.values())
    overheads = {routing: m - least for routing, m in above.items()}
    return _fit_curve(turns, overheads), overheads


def fit_prefill(runs: Iterable[Mapping[str, Any]]) -> tuple[float, float, float]:
    """(fixed ms, ms per token, ms per 1k keys attended: `ServiceCosts.prefill_ms`), of the
    engines: each routing's own overhead taken out (`fit_prefill_and_overheads`)."""
    return fit_prefill_and_overheads(runs)[0]


def fit_decode(runs: Iterable[Mapping[str, Any]]) -> tuple[float, float]:
    """(fixed ms, ms per sequence) of a decode step."""
    rows, ys = [], []
    for run in runs:
        records = _ok(run)
        engines = max(1, sum(e.get("role") in ("decode", "engine", None)
                             for e in run.get("config", {}).get("engines", [{}])))
        for r in records:
            if len(r.get("itl_ms") or []) < 4:
                continue
            first = r["started_at"] + r["ttft_ms"] / 1000
            beside = sum(1 for o in records if o["started_at"] < r["ended_at"]
                         and o["ended_at"] > first)
            rows.append([1.0, max(1.0, beside / engines)])
            ys.append(median(r["itl_ms"]))
    if len(rows) < 3:
        raise ValueError("too few streamed turns to fit a decode step")
    coef = _nonnegative_lstsq(np.asarray(rows), np.asarray(ys))
    return float(coef[0]), float(coef[1])


# The median of fewer turns than this is one or two turns' noise: no wait is fitted from it.
MIN_JOIN_TURNS = 5


def _waits_in_steps(run: Mapping[str, Any], costs: ServiceCosts
                    ) -> dict[bool, list[float]]:
    """The run's turns whose prompt ran alone on the engine that decodes them (no other
    prompt there in flight at or after their start), by whether other turns decoded there
    as they arrived: each one's time to the first token beyond the prefill curve and its
    routing's overhead, in decode steps of the batch it met."""
    routing = BENCH_ROUTINGS.get(run["mode"])
    out: dict[bool, list[float]] = {False: [], True: []}
    if routing not in ("affinity", "turnkv"):
        return out  # a P/D prompt reaches a prefill engine, which decodes nothing
    beside = _beside(run)
    for r in _ok(run):
        n = _computed(r)
        if not n or n < 16 or r.get("prefill_node") not in (None, r.get("decode_node")):
            continue
        start = r["started_at"]
        first = start + r["ttft_ms"] / 1000
        others = [o for o in beside(r) if o is not r and o["started_at"] < first
                  and o["ended_at"] > start]
        if any(o["started_at"] + o["ttft_ms"] / 1000 > start for o in others):
            continue
        left = r["ttft_ms"] - costs.prefill_ms(n, r["prompt_tokens"]) \
            - costs.turn_overhead_ms(routing)
        out[bool(others)].append(left / costs.decode_step_ms(len(others)))
    return out


def fit_join_wait(runs: Iterable[Mapping[str, Any]], costs: ServiceCosts, created: str = "~"
                  ) -> tuple[float, float]:
    """Decode steps a prompt reaching an engine that decodes other turns waits beyond the
    rest of the step in progress (`ServiceCosts.join_wait_steps`), on engines without and
    with a host tier (`tier_join_wait_steps`): the median of such turns' time beyond the
    curve (`_waits_in_steps`) less the median of those that reached an idle engine, less the
    half step the rest of the one in progress is on average. None (0) where either median
    has fewer than `MIN_JOIN_TURNS` turns."""
    groups: dict[bool, dict[bool, list[float]]] = {False: {False: [], True: []},
                                                   True: {False: [], True: []}}
    for run in runs:
        tier = tier_tokens(run, created) > 0
        for decoding, waits in _waits_in_steps(run, costs).items():
            groups[tier][decoding].extend(waits)

    def steps(group: dict[bool, list[float]]) -> float:
        if min(len(group[False]), len(group[True])) < MIN_JOIN_TURNS:
            return 0.0
        return max(0.0, median(group[True]) - median(group[False]) - 0.5)

    return steps(groups[False]), steps(groups[True])


# A turn's own decode steps after those that stored its prompt, at least: their median is its
# step beside the stores' (fewer would let one stall set it).
MIN_LATER_GAPS = 4


def _store_excess(run: Mapping[str, Any], block: int) -> list[float]:
    """Per turn whose prompt filled `n` blocks new to its engine (computed there), ms per
    block its first `n` gaps between output tokens took beyond `n` of its later ones'
    median: the tier's worker copies a prompt's new blocks from the turn's first decode step
    on (a block a step since the stores were paced, all in that step before), on the
    engine's core."""
    out = []
    for r in _ok(run):
        gaps = r.get("itl_ms") or []
        prompt, computed = r["prompt_tokens"], _computed(r) or 0
        new = prompt // block - (prompt - computed) // block
        if new < 1 or len(gaps) < new + MIN_LATER_GAPS:
            continue
        out.append((sum(gaps[:new]) - new * median(gaps[new:])) / new)
    return out


def fit_store_cost(runs: Iterable[Mapping[str, Any]], block: int, created: str = "~"
                   ) -> float:
    """Ms a step of an engine with a host tier takes longer per block it copies there
    (`ServiceCosts.tier_store_ms_per_block`): the median of `_store_excess` over the turns
    of runs with a tier less its median over runs without one (a turn's first steps may
    take longer without a store: that is not the store's), of the modes that decode on the
    engine that computed the prompt. None (0) with fewer than `MIN_JOIN_TURNS` turns a side;
    never negative."""
    sides: dict[bool, list[float]] = {False: [], True: []}
    for run in runs:
        if BENCH_ROUTINGS.get(run["mode"]) in ("affinity", "turnkv"):
            sides[tier_tokens(run, created) > 0].extend(_store_excess(run, block))
    if min(len(turns) for turns in sides.values()) < MIN_JOIN_TURNS:
        return 0.0
    return max(0.0, median(sides[True]) - median(sides[False]))


def fit_transfer(runs: Iterable[Mapping[str, Any]], step_ms: float) -> float | None:
    """Tokens per ms moved from the prefill to the decode engine, or None without P/D turns."""
    tokens = ms = 0.0
    for run in runs:
        if run["mode"] not in ("standard", "standard-nocache"):
            continue
        for r in _ok(run):
            phase = r.get("prefill_phase_ms")
            if phase:
                tokens += r["prompt_tokens"]
                ms += max(0.0, r["ttft_ms"] - phase - step_ms)
    return tokens / ms if tokens and ms > 0 else None


def block_size(runs: Iterable[Mapping[str, Any]], default: int = 16) -> int:
    """The engines' KV block size: the runs' configured one, else the largest that divides
    every prefix hit and the bench's own default (vLLM's on CPU): hits that all happen to be
    multiples of 256 say only that the block divides 256, and runs that record no hit (the
    pooled modes' records name none) ran that default. The hits are those of the modes the
    simulator replays (`BENCH_ROUTINGS`): another P/D mode's `prefill_reused` counts KV it
    moved, the whole prompt's, which ends wherever the prompt does."""
    runs = list(runs)
    configured = [r.get("config", {}).get("block_size") for r in runs]
    if any(configured):
        return int(next(c for c in configured if c))
    hits = [int(r[k]) for run in runs if run["mode"] in BENCH_ROUTINGS
            for r in run["records"] for k in ("prefill_cached", "prefill_reused") if r.get(k)]
    found = VLLM_CPU_BLOCK_TOKENS
    for h in hits:
        found = math.gcd(found, h)
    return found if found >= 8 else default


def _cores_per_engine(run: Mapping[str, Any]) -> int | None:
    cores = run.get("config", {}).get("cores_per_engine")
    return int(cores) if cores else None


def on_simulated_engines(runs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The runs whose engines are the ones the simulator replays: as many cores each as the
    engines of the modes it has a routing for (`BENCH_ROUTINGS`). An engine of two cores
    (the bench's `single-2core`) computes a prompt in about half the time: its turns would
    pull the curve below what an engine of one core costs. Runs that do not record their
    cores are kept."""
    shapes = {_cores_per_engine(r) for r in runs if r["mode"] in BENCH_ROUTINGS} - {None}
    if len(shapes) != 1:
        return list(runs)
    return [r for r in runs if _cores_per_engine(r) in shapes | {None}]


def calibrate(result: Mapping[str, Any], modes: Sequence[str] | None = None,
              name: str = "calibrated") -> ServiceCosts:
    """The cost model of a bench result's runs (of `modes`, default all that finished, on
    the simulated engines: `on_simulated_engines`)."""
    runs = on_simulated_engines([r for r in result["runs"]
                                 if (modes is None or r["mode"] in modes)
                                 and r.get("status", {}).get("state", "ok") == "ok"])
    if not runs:
        raise ValueError(f"no finished runs of {modes} in the result")
    (fixed, per_token, per_kctx), overheads = fit_prefill_and_overheads(runs)
    d0, d1 = fit_decode(runs)
    rate = fit_transfer(result["runs"], d0 + d1) or 50.0
    sized = [r for r in runs if r.get("kv_cache_tokens")]
    capacity = int(sized[0]["kv_cache_tokens"]) if sized else 23_296
    config = sized[0].get("config", {}) if sized else {}
    kv_bytes = int(config["kv_cache_bytes"] / capacity) if config.get("kv_cache_bytes") \
        else 0
    costs = ServiceCosts(name, fixed, per_token, per_kctx, d0, d1, rate, rate, capacity,
                         block_size(result["runs"]), kv_bytes, routing_overhead_ms=overheads,
                         source=f"turnkv bench {result.get('workload', {}).get('name')} on "
                                f"{result.get('model')}, {result.get('created', '?')}")
    created = result.get("created", "~")
    plain, tier = fit_join_wait(runs, costs, created)
    return replace(costs, join_wait_steps=plain, tier_join_wait_steps=tier,
                   tier_store_ms_per_block=fit_store_cost(runs, costs.block_size, created))


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient at least 0: a negative cost per token fits noise.
    Drops the most negative coefficient's column and refits until none is negative."""
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(a.shape[1])
            out[keep] = np.maximum(coef, 0)
            return out
        keep.pop(int(np.argmin(coef)))
