"""Fleet-sizing curves: the same fleet under more and more live sessions per engine, each
policy's hit rate and TTFT at each load; the curve a platform team sizes a fleet by.

Each point is a closed population: `per_engine x engines` sessions, all live at once (started
within the first seconds), each played to its end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from turnkv_server.sim.fleet import Fleet, FleetSpec
from turnkv_server.sim.sessions import SimSession
from turnkv_server.sim.summary import summarize

Sessions = Callable[[int], Sequence[SimSession]]  # a population of n sessions


def sizing_curve(specs: Sequence[FleetSpec], per_engine: Sequence[int], sessions: Sessions,
                 progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    points = []
    for load in per_engine:
        population = sessions(load * specs[0].engines)
        for spec in specs:
            summary = summarize(Fleet(replace(spec)).run(population))
            summary["sessions_per_engine"] = load
            points.append(summary)
            if progress is not None:
                progress(f"{load} sessions per engine, {spec.label()}: hit rate "
                         f"{summary['hit_rate']}, TTFT later p50 "
                         f"{summary['ttft_ms_later']['p50']} ms")
    return points
