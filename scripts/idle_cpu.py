"""How much CPU an idle engine uses while it holds sessions' KV, per serving mode.

For each mode: start a cluster (SmolLM2 unless --model), play --sessions sessions of --turns
turns each through the router without ending them (so the engines hold their KV: turnkv's
leases, upstream bidirectional's delay-freed blocks), wait --settle seconds, then measure each
engine's process group (API server, engine core, worker) over --window seconds of silence.
Writes the figures to --out as JSON and prints a table. --threads also names the threads that
spent the most (and how often each woke): where an idle engine's CPU goes.

    python scripts/idle_cpu.py --modes turnkv,bidirectional --out docs/bench/idle-cpu.json

`turnkv-tier` is turnkv with a host-memory tier of --tier-host-blocks blocks below each
engine's cache (docs/tier.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from turnkv_server.bench.cputime import group_deltas, snapshot_groups
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterConfig
from turnkv_server.launcher.processes import group_members

QUESTION = ("Explain in two sentences why a write-ahead log needs fsync, and what group commit "
            "changes about its cost. ")


def play(router: str, model: str, sessions: int, turns: int) -> None:
    with httpx.Client(timeout=600) as client:
        for s in range(sessions):
            messages: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]
            for t in range(turns):
                messages.append({"role": "user", "content": QUESTION * (t + 1)})
                reply = client.post(f"{router}/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": 16, "temperature": 0,
                    "turnkv": {"session_id": f"idle-{s}", "turn": t + 1}})
                reply.raise_for_status()
                messages.append({"role": "assistant",
                                 "content": reply.json()["choices"][0]["message"]["content"]})


# (process name, thread name, thread id) -> (CPU seconds, times it woke from sleep)
Threads = dict[tuple[str, str, int], tuple[float, int]]


def snapshot_threads(pgid: int) -> Threads:
    """Every thread of the process group `pgid`: its CPU time and its voluntary context
    switches (each one a sleep it woke from), from /proc."""
    found: Threads = {}
    tick = os.sysconf("SC_CLK_TCK")
    for proc in group_members(pgid):
        with contextlib.suppress(OSError, psutil.Error):
            name = proc.name()
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    status = (task / "status").read_text()
                    woke = next(int(line.split()[1]) for line in status.splitlines()
                                if line.startswith("voluntary_ctxt_switches"))
                    comm = (task / "comm").read_text().strip()
                    found[(name, comm, int(task.name))] = (
                        (int(fields[11]) + int(fields[12])) / tick, woke)
    return found


def busiest_threads(before: Threads, after: Threads, seconds: float, top: int = 8
                    ) -> list[dict[str, Any]]:
    rows = []
    for key, (cpu, woke) in after.items():
        cpu0, woke0 = before.get(key, (0.0, 0))
        rows.append({"process": key[0], "thread": key[1], "tid": key[2],
                     "percent_of_a_core": round(100 * (cpu - cpu0) / seconds, 2),
                     "wakeups_per_s": round((woke - woke0) / seconds, 1)})
    rows.sort(key=lambda r: (r["percent_of_a_core"], r["wakeups_per_s"]), reverse=True)
    return rows[:top]


def measure(mode: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    tier = mode == "turnkv-tier"
    config = ClusterConfig(mode="turnkv" if tier else mode,
                           model=args.model, dtype="float32",
                           tier_host_blocks=args.tier_host_blocks if tier else None)
    with Cluster(config, console=console) as state:
        play(state.router, state.served_model_name, args.sessions, args.turns)
        time.sleep(args.settle)
        groups = {e.name: e.pid for e in state.engines}
        held = {}
        if config.mode == "turnkv":
            for name, url in zip(groups, [e.url for e in state.engines], strict=True):
                counters = fetch_connector_counters(url)
                held[name] = {"leases": counters.get("leases"),
                              "pinned_blocks": counters.get("pinned_blocks")}
        threads_before = {n: snapshot_threads(p) for n, p in groups.items()} \
            if args.threads else {}
        before = snapshot_groups(groups)
        started = time.monotonic()
        time.sleep(args.window)
        seconds = time.monotonic() - started
        cpu = group_deltas(before, snapshot_groups(groups))
        threads = {n: busiest_threads(threads_before[n], snapshot_threads(p), seconds)
                   for n, p in groups.items()} if args.threads else {}
    result = {"mode": mode, "window_s": round(seconds, 1), "cpu_s": cpu,
              "percent_of_a_core": {name: round(100 * c / seconds, 1)
                                    for name, c in cpu.items()},
              "held": held}
    if threads:
        result["busiest_threads"] = threads
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="turnkv,bidirectional")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--tier-host-blocks", type=int, default=256)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", action="store_true",
                        help="also name each engine's busiest threads")
    args = parser.parse_args()
    console = Console(stderr=True)
    results = [measure(mode.strip(), args, console) for mode in args.modes.split(",")]
    table = Table("mode", "engine", "CPU s", "% of a core", "leases held")
    for result in results:
        for name, cpu in result["cpu_s"].items():
            held = result["held"].get(name, {}).get("leases")
            table.add_row(result["mode"], name, f"{cpu:.2f}",
                          f"{result['percent_of_a_core'][name]:.1f}",
                          "" if held is None else f"{held:.0f}")
    Console().print(table)
    for result in results:
        for name, rows in result.get("busiest_threads", {}).items():
            threads = Table("process", "thread", "% of a core", "wake-ups/s",
                            title=f"{result['mode']} {name}: busiest threads")
            for row in rows:
                threads.add_row(row["process"], row["thread"], f"{row['percent_of_a_core']:.2f}",
                                f"{row['wakeups_per_s']:.1f}")
            Console().print(threads)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"sessions": args.sessions, "turns": args.turns,
                                        "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
