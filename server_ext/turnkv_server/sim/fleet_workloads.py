"""Workloads at fleet scale: many sessions of a known shape, arriving over time.

- `blog_sessions`: vLLM's multi-turn blog workload as `bench.estimate.blog_workload` reads it
  (10 turns, +150 tokens in and 300 out per turn, the last prompt at 24k tokens), with agent
  tool time between turns (`agent-pressure`'s: lognormal, median 4 s, clipped at 60 s; the
  blog does not say) and the client's hint of it;
- `tile`: a small workload's sessions repeated under new IDs, so that a bench preset's shapes
  can fill a thousand engines without generating its text a hundred thousand times.

Starts are a Poisson process of `rate` sessions per second, or all within `stagger_s` (a
closed population: every session live at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from turnkv_server.bench.estimate import blog_workload
from turnkv_server.bench.presets import preset_params
from turnkv_server.sim.sessions import SimSession, SimTurn


def _starts(rng: np.random.Generator, n: int, rate: float | None,
            stagger_s: float) -> np.ndarray:
    if rate:
        return np.concatenate(([0.0], np.cumsum(rng.exponential(1 / rate, n - 1))))
    return rng.uniform(0, stagger_s, n)


def blog_sessions(n: int, context_tokens: int = 24_000, seed: int = 0,
                  rate: float | None = None, stagger_s: float = 10.0) -> list[SimSession]:
    shape = blog_workload(context_tokens)
    gaps = preset_params("agent-pressure")
    rng = np.random.default_rng([seed, 32])
    starts = _starts(rng, n, rate, stagger_s)
    draws = np.clip(gaps.think_time_median_s * np.exp(
        gaps.think_time_sigma * rng.standard_normal((n, len(shape)))), 0,
        gaps.think_time_max_s)
    return [SimSession(f"blog-{i:06d}",
                       tuple(SimTurn(t.new_tokens, t.output_tokens,
                                     0.0 if k == 0 else round(float(draws[i, k]), 3))
                             for k, t in enumerate(shape)),
                       round(float(starts[i]), 3))
            for i in range(n)]


def tile(sessions: Sequence[SimSession], n: int, seed: int = 0, rate: float | None = None,
         stagger_s: float = 10.0) -> list[SimSession]:
    """`n` sessions cycling through `sessions`' shapes, with new IDs and starts."""
    rng = np.random.default_rng([seed, 33])
    starts = _starts(rng, n, rate, stagger_s)
    out = []
    for i in range(n):
        shape = sessions[i % len(sessions)]
        out.append(replace(shape, session_id=f"{shape.session_id}-{i:06d}",
                           start_s=round(float(starts[i]), 3)))
    return out
