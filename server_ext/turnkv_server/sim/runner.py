"""`turnkv sim`: build the sessions and the fleets its options name, run them with progress,
write what they did."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TimeElapsedColumn

from turnkv_server.sim import report
from turnkv_server.sim.bench_modes import BENCH_ROUTINGS
from turnkv_server.sim.bench_workloads import preset_sessions, replay_records
from turnkv_server.sim.calibration import calibrate, load_results
from turnkv_server.sim.fleet import Fleet, FleetSpec
from turnkv_server.sim.fleet_workloads import blog_sessions, tile
from turnkv_server.sim.gpu_profiles import PROFILES
from turnkv_server.sim.mooncake_trace import read_mooncake
from turnkv_server.sim.policy_specs import DEFAULT_POLICIES, parse_policy
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.sessions import SimSession
from turnkv_server.sim.sizing import sizing_curve
from turnkv_server.sim.summary import summarize
from turnkv_server.sim.traces import read_trace
from turnkv_server.sim.validation import validate

# Validated in every file (a row says where one has no run of it); the other modes the
# simulator has a routing for (`bench_modes`) where a file has runs of them.
VALIDATED_MODES = ("affinity", "standard", "turnkv", "affinity-offload", "bound")
SIZING_JOIN_S = 10.0


@dataclass(frozen=True)
class SimOptions:
    workload: str = "agent"
    trace: Path | None = None
    mooncake: Path | None = None
    replay: Path | None = None
    replay_mode: str = "affinity"
    sessions: int | None = None
    rate: float | None = None
    context: int = 24_000
    engines: int = 2
    policies: tuple[str, ...] = ()
    tier_tokens: int = 0
    profile: str = "h200-qwen3-32b"
    kv_cache_tokens: int | None = None
    per_engine: str | None = None
    lose: tuple[str, ...] = ()
    admission_tokens: int | None = None
    itl_target_ms: float | None = None
    validate: tuple[Path, ...] = ()
    seed: int = 0
    out: Path = Path("sim-out")


def load_costs(profile: str, kv_cache_tokens: int | None = None) -> ServiceCosts:
    if profile.startswith("calibrated:"):
        costs = calibrate(load_results(Path(profile.removeprefix("calibrated:"))))
    elif profile in PROFILES:
        costs = PROFILES[profile].costs()
    else:
        raise ValueError(f"unknown profile {profile!r}: calibrated:RESULTS.json or one of "
                         f"{', '.join(PROFILES)}")
    return replace(costs, kv_capacity_tokens=kv_cache_tokens) if kv_cache_tokens else costs


def load_sessions(o: SimOptions, n: int | None = None, stagger_s: float = 10.0
                  ) -> tuple[list[SimSession], int | None]:
    """The sessions the options name, `n` of them (default: `--sessions`, else the source's
    own; starting within `stagger_s` without `--rate`), and the closed loop's concurrency
    (None: open)."""
    n = n or o.sessions
    concurrency = None
    if o.trace is not None:
        found = read_trace(o.trace)
    elif o.mooncake is not None:
        found = read_mooncake(o.mooncake)
    elif o.replay is not None:
        result = load_results(o.replay)
        runs = [r for r in result["runs"] if r["mode"] == o.replay_mode]
        if not runs:
            raise ValueError(f"{o.replay} has no {o.replay_mode} run")
        found = replay_records(runs[0]["records"])
        concurrency = result.get("workload", {}).get("concurrency")
    elif o.workload == "blog":
        return blog_sessions(n or 10, o.context, o.seed, o.rate, stagger_s), None
    else:
        found, concurrency = preset_sessions(o.workload, o.seed)
    if n is not None:
        return tile(found, n, o.seed, o.rate, stagger_s), None
    return found, concurrency


def _specs(o: SimOptions, costs: ServiceCosts, concurrency: int | None) -> list[FleetSpec]:
    lose = []
    for item in o.lose:
        index, _, at = item.partition("@")
        lose.append((int(index), float(at)))
    base = FleetSpec("affinity", o.engines, costs, admission_tokens=o.admission_tokens,
                     itl_target_ms=o.itl_target_ms, concurrency=concurrency,
                     lose=tuple(lose))
    return [parse_policy(p, base, o.tier_tokens) for p in o.policies or DEFAULT_POLICIES]


def run_sim(o: SimOptions, console: Console | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    if o.validate:
        return _validate(o, console)
    costs = load_costs(o.profile, o.kv_cache_tokens)
    if o.per_engine:
        return _sizing(o, costs, console)
    sessions, concurrency = load_sessions(o)
    specs = _specs(o, costs, concurrency)
    turns = sum(len(s.turns) for s in sessions)
    summaries, ttfts = [], {}
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        for spec in specs:
            task = bar.add_task(spec.label(), total=turns)
            started = time.perf_counter()
            def advance(done: int, task: TaskID = task) -> None:
                bar.update(task, completed=done)

            run = Fleet(spec).run(sessions, advance, every=max(100, turns // 200))
            summary = summarize(run)
            summary["wall_s"] = round(time.perf_counter() - started, 2)
            summaries.append(summary)
            ttfts[spec.label()] = [x.ttft_ms for x in run.outcomes if x.turn > 0]
    payload = {"command": "turnkv sim", "options": _jsonable(o), "costs": costs.to_json(),
               "sessions": len(sessions), "turns": turns, "policies": summaries}
    table = report.summary_table(summaries)
    paths = report.write_results(o.out, payload, table)
    paths.append(report.plot_ttft_cdf(ttfts, o.out / "ttft_cdf.png"))
    console.print(table)
    for path in paths:
        console.print(f"wrote {path}")
    return payload


def _sizing(o: SimOptions, costs: ServiceCosts, console: Console) -> dict[str, Any]:
    loads = [int(x) for x in (o.per_engine or "").split(",") if x.strip()]
    specs = _specs(o, costs, None)
    # Sessions join one per engine every 10 s on average: at every load the cold first
    # prompts arrive at one rate, and the curve shows what holding them costs.
    points = sizing_curve(specs, loads,
                          lambda n: load_sessions(o, n, SIZING_JOIN_S * n / o.engines)[0],
                          lambda line: console.print(line))
    payload = {"command": "turnkv sim --per-engine", "options": _jsonable(o),
               "costs": costs.to_json(), "points": points}
    paths = report.write_results(o.out, payload, report.summary_table(points))
    paths.append(report.plot_curves(points, "sessions_per_engine", "live sessions per engine",
                                    o.out / "sizing.png",
                                    f"{costs.name}: {o.engines} engines, {o.workload}"))
    for path in paths:
        console.print(f"wrote {path}")
    return payload


def _validate(o: SimOptions, console: Console) -> dict[str, Any]:
    rows = []
    for path in o.validate:
        result = load_results(path)
        ran = {run["mode"] for run in result["runs"]}
        extra = [m for m in BENCH_ROUTINGS if m in ran and m not in VALIDATED_MODES]
        for row in validate(result, (*VALIDATED_MODES, *extra)):
            rows.append({**row, "workload": result["workload"]["name"], "source": str(path)})
    table = report.validation_table(rows)
    paths = report.write_results(o.out, {"command": "turnkv sim --validate", "rows": rows},
                                 table)
    console.print(table)
    for written in paths:
        console.print(f"wrote {written}")
    return {"rows": rows}


def _jsonable(o: SimOptions) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else list(map(str, v))
                if isinstance(v, Sequence) and not isinstance(v, str) else v)
            for k, v in o.__dict__.items()}
