"""The soak's record (scripts/soak.py): the JSON of a run, the goals it missed, and the plot of
every process's memory over time."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from soak_cluster import Soak
from soak_turns import SoakTally

from tests.support.run_record import header, missed_goals, percentiles, write_json


def memory_summary(samples: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per process: first, last and highest RSS (MiB), and its trend (MiB a minute, least
    squares) over the second half of its last life (since its last restart, if any): where
    warming up is over, growth that goes on is what a leak would show."""
    summary: dict[str, dict[str, float | None]] = {}
    for name in sorted({n for p in samples for n in p["rss_mib"]}):
        points = [(p["t_s"], p["rss_mib"].get(name), p.get("pids", {}).get(name))
                  for p in samples]
        values = [v for _, v, _ in points if v is not None]
        if not values:
            continue
        life: list[tuple[float, float]] = []
        pid = None
        for t, v, this_pid in points:
            if v is None or this_pid != pid:
                life, pid = [], this_pid
            if v is not None:
                life.append((t, v))
        half = life[len(life) // 2:]
        trend = None
        if len(half) >= 3 and half[-1][0] > half[0][0]:
            slope = statistics.linear_regression([t for t, _ in half], [v for _, v in half])
            trend = round(slope.slope * 60, 2)
        summary[name] = {"first": values[0], "last": values[-1], "max": max(values),
                         "trend_mib_per_min_late": trend}
    return summary


def report(command: str, started: float, run_dir: Path, plan: Any, cluster: dict[str, Any],
           soak: Soak, tally: SoakTally, after: dict[str, Any], logs: dict[str, Any],
           out: Path, plot: Path, console: Console) -> list[str]:
    """Write the run's JSON and memory plot; the goals missed."""
    caps: dict[str, int] = cluster["pin_caps"]
    pinned_max: dict[str, float] = {}
    for point in soak.samples:
        for name, kv in point["kv"].items():
            if kv.pinned_blocks is not None:
                pinned_max[name] = max(pinned_max.get(name, 0.0), kv.pinned_blocks)
    lost_by_kind = {k: n for k, n in tally.results.items() if k != "ok"}
    record = header(command, started, run_dir) | {
        "plan": asdict(plan), "cluster": cluster,
        "seconds": soak.samples[-1]["t_s"] if soak.samples else None,
        "faults": [asdict(f) for f in soak.faults],
        "turns": {"attempted": tally.attempted, "ok": tally.results["ok"],
                  "ok_first_try": tally.ok_first_try, "ok_after_retry": tally.ok_after_retry,
                  "lost": tally.lost_count, "lost_by_kind": lost_by_kind,
                  "short_deltas": tally.short_deltas,
                  "seconds": percentiles(tally.latencies)},
        "attempts": {"by_kind": dict(tally.attempt_kinds),
                     "statuses": {str(s): n for s, n in sorted(tally.statuses.items())}},
        "answers_500_or_above": sum(n for s, n in tally.statuses.items() if s >= 500),
        "answers_500_or_above_but_503": len(tally.server_errors),
        "server_errors": tally.server_errors[:100],
        "lost_turns": tally.lost[:200],
        "retried_turns": tally.retried,
        "pinned_max": pinned_max,
        "memory_mib": memory_summary(soak.samples),
        "after": after,
        "samples": soak.samples,
        "logs": logs,
    }
    write_json(out, record)
    plot_memory(soak, caps, plot)
    console.print(f"wrote {out} and {plot}")
    console.print(f"turns {tally.attempted}: ok {tally.results['ok']} (after a retry "
                  f"{tally.ok_after_retry}), lost {tally.lost_count} {lost_by_kind}; answers "
                  f">= 500 other than 503: {len(tally.server_errors)}; pinned at most "
                  f"{pinned_max} (caps {caps}); blocks clear "
                  f"{after['clear_idle_after_s']} s after the last turn")
    for name, memory in record["memory_mib"].items():
        console.print(f"  {name}: {memory['first']} -> {memory['last']} MiB (max "
                      f"{memory['max']}; late trend {memory['trend_mib_per_min_late']} MiB/min)")
    return missed_goals({
        "lost turns": tally.lost_count,
        "answers at 500 or above other than 503": tally.server_errors,
        "a fault not injected or not recovered": any(f.error for f in soak.faults),
        "pins over the cap": any(pinned_max.get(n, 0) > c for n, c in caps.items()),
        "blocks left pinned or in use": not after["clear_idle"],
    })


def plot_memory(soak: Soak, caps: dict[str, int], path: Path) -> None:
    """Memory of every process over the run (engines apart: they are ten times larger, and
    a router's growth would not show beside them), each engine's pinned blocks against its
    cap, the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (big, small, pins) = plt.subplots(3, 1, figsize=(10, 9), sharex=True,
                                           gridspec_kw={"height_ratios": [2, 2, 1.4]})
    minutes = [p["t_s"] / 60 for p in soak.samples]
    for name in sorted({n for p in soak.samples for n in p["rss_mib"]}):
        axis = big if name in caps else small
        axis.plot(minutes, [p["rss_mib"].get(name) for p in soak.samples], label=name)
    big.set_ylabel("engines: RSS (MiB)")
    small.set_ylabel("others: RSS (MiB)")
    big.set_title("Soak: resident memory of every process (an engine: all processes of its "
                  "group)")
    for engine in sorted(caps):
        pins.plot(minutes, [p["kv"][engine].pinned_blocks if engine in p["kv"] else None
                            for p in soak.samples], label=f"{engine} pinned")
    if caps:
        cap = max(caps.values())
        pins.axhline(cap, linestyle=":", color="grey")
        pins.text(0, cap, " pin cap", va="bottom", color="grey")
        pins.set_ylim(top=cap * 1.2)
    pins.set_ylabel("blocks pinned")
    pins.set_xlabel("minutes (red dashed: SIGKILL; green dotted: back in service)")
    for axis in (big, small, pins):
        axis.set_ylim(bottom=0)  # a leak shows as a slope, not as a zoomed-in wobble
        for fault in soak.faults:
            if fault.killed_at_s is not None:
                axis.axvline(fault.killed_at_s / 60, color="red", linestyle="--", linewidth=1)
            if fault.back_at_s is not None:
                axis.axvline(fault.back_at_s / 60, color="green", linestyle=":", linewidth=1)
    for fault in soak.faults:
        if fault.killed_at_s is not None:
            big.annotate(f"kill -9 {fault.what}", (fault.killed_at_s / 60, 0.02), rotation=90,
                         xycoords=("data", "axes fraction"), va="bottom", ha="right",
                         fontsize=8, color="red")
    for axis in (big, small):
        axis.legend(loc="upper left", fontsize=8, ncol=4)
    pins.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
