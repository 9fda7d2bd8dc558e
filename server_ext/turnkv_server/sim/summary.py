"""A run's figures: hit rate, TTFT and ITL distributions, KV moved, tier traffic, engine
utilisation; as the bench reports them where it has the same figure (`bench.summary`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from turnkv_server.sim.fleet import FleetRun

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, **{f"p{p}": None for p in PERCENTILES}}
    found = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {"n": len(values), **{f"p{p}": round(float(v), 2)
                                 for p, v in zip(PERCENTILES, found, strict=True)}}


def summarize(run: FleetRun) -> dict[str, Any]:
    outcomes = run.outcomes
    prompt = sum(o.prompt for o in outcomes)
    computed = sum(o.computed for o in outcomes)
    later = [o for o in outcomes if o.turn > 0]
    later_prompt = sum(o.prompt for o in later)
    duration = max(run.duration_s, 1e-9)
    kv_bytes = run.spec.costs.kv_bytes_per_token
    return {
        "label": run.spec.label(),
        "routing": run.spec.routing,
        "eviction": run.spec.order,
        "tier_tokens": run.spec.tier_tokens,
        "shared_tier": run.spec.shared_tier,
        "engines": run.spec.engines,
        "turns": len(outcomes),
        "sessions": len({o.session for o in outcomes}),
        "simulated_s": round(run.duration_s, 2),
        # As the bench's `1 - recompute_fraction`: prompt tokens not computed, all turns.
        "hit_rate": round(1 - computed / prompt, 4) if prompt else None,
        "hit_rate_later": round(1 - sum(o.computed for o in later) / later_prompt, 4)
        if later_prompt else None,
        "ttft_ms": percentiles([o.ttft_ms for o in outcomes]),
        "ttft_ms_later": percentiles([o.ttft_ms for o in later]),
        "itl_ms": percentiles([v for o in outcomes if (v := o.itl_ms) is not None]),
        "waited_ms": percentiles([o.waited_ms for o in outcomes]),
        "prompt_tokens": {"total": prompt, "computed": computed,
                          "cached": sum(o.cached for o in outcomes),
                          "from_tier": sum(o.from_tier for o in outcomes)},
        "kv_moved_tokens": run.traffic.kv_moved_tokens,
        "tier_read_tokens": run.traffic.tier_read_tokens,
        "kv_moved_bytes": run.traffic.kv_moved_tokens * kv_bytes,
        "tier_written_bytes": run.traffic.tier_written_tokens * kv_bytes,
        "tier_read_bytes": run.traffic.tier_read_tokens * kv_bytes,
        "overcommits": run.traffic.overcommits,
        "preempted_tokens": run.traffic.preempted_tokens,
        "admission_waits": run.traffic.admission_waits,
        "placements": run.decisions or dict(Counter(o.where for o in outcomes)),
        "utilisation": {
            "prefill": round(sum(e.prefill_busy_s for e in run.engines)
                             / (duration * len(run.engines)), 4),
            "decode": round(sum(e.decode_busy_s for e in run.engines)
                            / (duration * len(run.engines)), 4)},
    }
