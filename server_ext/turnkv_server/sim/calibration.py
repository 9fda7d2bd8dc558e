"""The cost model fitted from `turnkv bench` results (its results.json), by least squares.

- prefill: turns that ran alone (no other turn of the run in flight on their engine, where
  the run's counters tell each session's engine, else on any, from their start to their
  first token), their time to the first token (P/D modes: the prefill phase) against the
  tokens they computed and the prompt's length;
- decode: each turn's median gap between output tokens against the turns decoding beside it
  (those in flight during its decode, per decoding engine);
- transfer: `standard` turns, the time from the prefill's end to the first token less one
  decode step, against the prompt's tokens (the whole prompt's KV moves);
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
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from turnkv_server.bench.cli import VLLM_CPU_BLOCK_TOKENS
from turnkv_server.sim.bench_workloads import bench_homes
from turnkv_server.sim.service_costs import ServiceCosts

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
    """The turns of the run that could have slowed a turn's prefill: where the run's sessions'
    engines are known (`bench_homes`: pooled engines, one core each), those on its engine;
    else all of them."""
    records = _ok(run)
    homes = bench_homes(run)
    if not homes:
        return lambda _: records
    by_engine: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        by_engine.setdefault(homes[r["session_id"]], []).append(r)
    return lambda r: by_engine[homes[r["session_id"]]]


def fit_prefill(runs: Iterable[Mapping[str, Any]]) -> tuple[float, float, float]:
    """(fixed ms, ms per token, ms per token per 1k tokens of context)."""
    rows, ys = [], []
    for run in runs:
        beside = _beside(run)
        for r in _ok(run):
            n, ms = _computed(r), _prefill_ms(r, run["mode"])
            if n and ms and n >= 16 and _alone(r, beside(r)):
                rows.append([1.0, n, n * r["prompt_tokens"] / 1000])
                ys.append(ms)
    if len(rows) < 3:
        raise ValueError("too few turns that ran alone to fit a prefill cost")
    coef = _nonnegative_lstsq(np.asarray(rows), np.asarray(ys))
    return float(coef[0]), float(coef[1]), float(coef[2])


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
    multiples of 256 say only that the block divides 256."""
    runs = list(runs)
    configured = [r.get("config", {}).get("block_size") for r in runs]
    if any(configured):
        return int(next(c for c in configured if c))
    hits = [int(r[k]) for run in runs for r in run["records"]
            for k in ("prefill_cached", "prefill_reused") if r.get(k)]
    found = VLLM_CPU_BLOCK_TOKENS if hits else 0
    for h in hits:
        found = math.gcd(found, h)
    return found if found >= 8 else default


def calibrate(result: Mapping[str, Any], modes: Sequence[str] | None = None,
              name: str = "calibrated") -> ServiceCosts:
    """The cost model of a bench result's runs (of `modes`, default all that finished)."""
    runs = [r for r in result["runs"] if (modes is None or r["mode"] in modes)
            and r.get("status", {}).get("state", "ok") == "ok"]
    if not runs:
        raise ValueError(f"no finished runs of {modes} in the result")
    fixed, per_token, per_kctx = fit_prefill(runs)
    d0, d1 = fit_decode(runs)
    rate = fit_transfer(result["runs"], d0 + d1) or 50.0
    sized = [r for r in runs if r.get("kv_cache_tokens")]
    capacity = int(sized[0]["kv_cache_tokens"]) if sized else 23_296
    config = sized[0].get("config", {}) if sized else {}
    kv_bytes = int(config["kv_cache_bytes"] / capacity) if config.get("kv_cache_bytes") \
        else 0
    return ServiceCosts(name, fixed, per_token, per_kctx, d0, d1, rate, rate, capacity,
                        block_size(result["runs"]), kv_bytes,
                        source=f"turnkv bench {result.get('workload', {}).get('name')} on "
                               f"{result.get('model')}, {result.get('created', '?')}")


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
