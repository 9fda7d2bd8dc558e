"""The benchmark runner: every requested mode, one after another, on the same workload;
with repeats, the modes in turn again (A B C A B C), so that drift hits every mode alike.

For each mode the launcher starts a fresh cluster from the same settings, the driver plays the
workload through the SDK while counters and CPU times are taken around it, and the cluster is
stopped whatever happened. A mode that fails to start or stalls is recorded as such, with
whatever turns it played, and the run goes on with the next mode.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnkv_server.bench import plots, report
from turnkv_server.bench.aggregate import finalize
from turnkv_server.bench.counters import (
    counter_deltas,
    fetch_metrics,
    parse_counters,
    parse_kv_cache_tokens,
)
from turnkv_server.bench.cputime import group_deltas, snapshot_groups
from turnkv_server.bench.driver import DriveOutcome, Driver, DriveSettings
from turnkv_server.bench.plan import BenchSettings, cluster_config, run_config
from turnkv_server.bench.results import (
    BenchResult,
    MachineInfo,
    ModeRun,
    ModeStatus,
    WorkloadSummary,
)
from turnkv_server.bench.workloads import Workload
from turnkv_server.launcher import Cluster, ClusterState

RESULTS_FILE = "results.json"


def run_order(modes: list[str], repeat: int) -> list[tuple[int, str]]:
    """(repeat, mode) in the order they run: every mode once, then every mode again.

    Interleaved rather than each mode N times in a row, so that a slow drift of the machine
    (thermal state, another tenant, a filling disk) spreads over every mode instead of
    favouring the modes that ran first.
    """
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    return [(r, mode) for r in range(repeat) for mode in modes]


def mode_status(outcome: DriveOutcome) -> ModeStatus:
    """`stalled` if the watchdog stopped it; `failed` if no turn succeeded; else `ok`, with
    failed turns and session errors (opening or releasing one) counted in the detail."""
    errors = [r for r in outcome.records if r.error is not None]
    if outcome.stall is not None:
        return ModeStatus(state="stalled", detail=outcome.stall)
    if not outcome.records or len(errors) == len(outcome.records):
        first = errors[0].error if errors else "no turn was played"
        return ModeStatus(state="failed", detail=f"every turn failed; first: {first}")
    notes = []
    if errors:
        notes.append(f"{len(errors)} turn(s) failed; first: {errors[0].error}")
    if outcome.session_errors:
        notes.append(f"{len(outcome.session_errors)} session error(s); first: "
                     f"{outcome.session_errors[0]}")
    return ModeStatus(state="ok", detail="; ".join(notes) or None)


def _groups(state: ClusterState) -> dict[str, int]:
    """Process group leaders by name: each engine, and the router where there is one."""
    groups = {e.name: e.pid for e in state.engines}
    if state.router_process is not None:
        groups["router"] = state.router_process.pid
    return groups


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Runner:
    """Runs modes and writes results under `out`; see `run`."""

    def __init__(self, workload: Workload, settings: BenchSettings, out: Path,
                 console: Console | None = None) -> None:
        self.workload = workload
        self.settings = settings
        self.out = out
        self.console = console or Console(stderr=True)
        self.total_turns = sum(len(s.turns) for s in workload.sessions)

    def run(self, modes: list[str], baseline: str | None, command: list[str],
            repeat: int = 1) -> BenchResult:
        """Every mode in order, `repeat` times over (see `run_order`); returns the finalized
        result (also written to results.json)."""
        self.out.mkdir(parents=True, exist_ok=True)
        runs: list[ModeRun] = []
        served = self.settings.model
        for index, mode in run_order(modes, repeat):
            run, name = self.run_mode(mode, index if repeat > 1 else None)
            served = name or served
            runs.append(run)
            label = mode if repeat == 1 else f"{mode} (run {index + 1} of {repeat})"
            self.console.print(f"{label}: {report.status_label(run.status)}"
                               + (f", {run.wall_s:.0f} s" if run.wall_s else ""))
            # Written after every mode, so that an interrupted run keeps what it measured.
            partial = self._result(runs, served, baseline, command, repeat)
            (self.out / RESULTS_FILE).write_text(partial.model_dump_json(indent=1),
                                                 encoding="utf-8")
        return self._result(runs, served, baseline, command, repeat)

    def _result(self, runs: list[ModeRun], served: str, baseline: str | None,
                command: list[str], repeat: int) -> BenchResult:
        result = BenchResult(
            machine=MachineInfo.detect(),
            model=served,
            workload=WorkloadSummary(name=self.workload.name, kind=self.workload.kind,
                                     seed=self.workload.seed,
                                     sessions=len(self.workload.sessions),
                                     turns=self.total_turns,
                                     concurrency=self.workload.concurrency),
            command=command,
            runs=runs,
            repeats=repeat,
        )
        usable = baseline if any(r.mode == baseline for r in runs) else None
        return finalize(result, usable)

    def run_mode(self, mode: str, repeat: int | None = None) -> tuple[ModeRun, str | None]:
        """One mode on a fresh cluster; (its run, the served model name if it started).

        `repeat`: which run of the mode this is, when it runs more than once (its engine logs
        then go under runs/<mode>/<repeat + 1>/)."""
        run_dir = self.out / "runs" / mode
        if repeat is not None:
            run_dir = run_dir / str(repeat + 1)
        index = repeat or 0
        config = cluster_config(mode, self.settings, run_dir)
        described = run_config(mode, self.settings, config)
        self.console.rule(f"[bold]{mode}" + ("" if repeat is None else f" (run {index + 1})"))
        cluster = Cluster(config, console=self.console)
        try:
            state = cluster.start()
        except Exception as exc:  # the launcher has stopped whatever it started
            return ModeRun(mode=mode, repeat=index, config=described,
                           status=ModeStatus(state="failed",
                                             detail=f"cluster: {_first_line(exc)}")), None
        try:
            described["engines"] = [{"name": e.name, "role": e.role, "cores": e.cores}
                                    for e in state.engines]
            run = self._measure(mode, state, cluster, described)
            return run.model_copy(update={"repeat": index}), state.served_model_name
        finally:
            cluster.stop()

    def _measure(self, mode: str, state: ClusterState, cluster: Cluster,
                 described: dict[str, object]) -> ModeRun:
        engines = {e.name: e.url for e in state.engines}
        groups = _groups(state)
        before = {name: fetch_metrics(url) for name, url in engines.items()}
        sizes = [t for text in before.values() if text and (t := parse_kv_cache_tokens(text))]
        cpu_before = snapshot_groups(groups)
        settings = DriveSettings(base_url=state.router, model=state.served_model_name,
                                 mode=mode, turn_timeout_s=self.settings.turn_timeout_s,
                                 stall_timeout_s=self.settings.stall_timeout_s)
        started = time.perf_counter()
        outcome = self._drive(settings, cluster)
        wall_s = time.perf_counter() - started
        cpu_after = snapshot_groups(groups)
        counters: dict[str, dict[str, float]] = {}
        for name, url in engines.items():
            text_before, text_after = before[name], fetch_metrics(url)
            if text_before is not None and text_after is not None:
                counters[name] = counter_deltas(parse_counters(text_before),
                                                parse_counters(text_after))
        return ModeRun(
            mode=mode, config=described, records=outcome.records,
            status=mode_status(outcome), wall_s=round(wall_s, 3),
            cpu_s=group_deltas(cpu_before, cpu_after), engine_counters=counters,
            kv_cache_tokens=min(sizes) if sizes else None,
        )

    def _drive(self, settings: DriveSettings, cluster: Cluster) -> DriveOutcome:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("turns"), TimeElapsedColumn(), console=self.console) as bar:
            task = bar.add_task(settings.mode, total=self.total_turns)

            def advance(record: object) -> None:
                bar.advance(task)

            driver = Driver(self.workload, settings, on_turn=advance, stop_servers=cluster.stop)
            return asyncio.run(driver.run())


def write_outputs(result: BenchResult, out: Path) -> list[Path]:
    """results.json, summary.md and the plots into `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    path.write_text(result.model_dump_json(indent=1), encoding="utf-8")
    summary = out / "summary.md"
    summary.write_text(report.summary_markdown(result), encoding="utf-8")
    return [path, summary, *plots.write_plots(result, out)]
