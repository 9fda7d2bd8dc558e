"""Seconds each engine's scheduler spent in each state, from `sitecustomize.py`'s trace.

    python scripts/scheduler_trace/summarize.py /tmp/trace/*.log

Per log (one engine core): the run's span, the seconds with requests running and none
waiting, with requests waiting beside running ones (for KV blocks, as a rule), with requests
waiting and none running (deferred by the KV connector, or held for remote KV), and idle; and
the steps that deferred a lookup or found a preempted request. Logs whose spans overlap are
engines of one run: for each such run, the seconds during which one engine had a request
waiting while another had nothing at all to do (what placing that turn on the idle engine could
have used).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path


@dataclass(frozen=True)
class State:
    at: float
    running: int
    waiting: int
    deferred: int
    preempted: bool


def parse(lines: list[str]) -> list[State]:
    states = []
    for line in lines:
        fields = line.split()
        if not fields or not fields[0][0].isdigit():
            continue  # a trace error, kept in the log for the reader
        values = dict(field.split("=", 1) for field in fields[1:])
        states.append(State(float(fields[0]), int(values["running"]), int(values["waiting"]),
                            int(values["deferred"]), "PREEMPTED" in values["waiting_states"]))
    return states


def seconds_by_state(states: list[State]) -> Counter[str]:
    """Each state lasts until the next line (the last one's length is unknown: left out)."""
    seconds: Counter[str] = Counter()
    for state, after in pairwise(states):
        if state.waiting and state.running:
            name = "waiting beside running"
        elif state.waiting:
            name = "waiting, none running"
        elif state.running:
            name = "running, none waiting"
        else:
            name = "idle"
        seconds[name] += after.at - state.at
    return seconds


def state_at(states: list[State], at: float) -> State | None:
    """The engine's state at `at` (None: before its first line)."""
    current = None
    for state in states:
        if state.at > at:
            break
        current = state
    return current


def waiting_beside_idle(engines: list[list[State]]) -> float:
    """Seconds during which one engine had a request waiting and another was idle, over the
    span every engine traced."""
    start = max(states[0].at for states in engines)
    end = min(states[-1].at for states in engines)
    moments = sorted({s.at for states in engines for s in states if start <= s.at <= end}
                     | {start, end})
    total = 0.0
    for at, after in pairwise(moments):
        now = [state_at(states, at) for states in engines]
        waits = any(s is not None and s.waiting for s in now)
        idle = any(s is not None and not s.waiting and not s.running for s in now)
        if waits and idle:
            total += after - at
    return total


def runs(logs: dict[Path, list[State]]) -> list[list[Path]]:
    """The logs grouped by run: engines whose traced spans overlap."""
    groups: list[list[Path]] = []
    end = float("-inf")
    for log in sorted(logs, key=lambda path: logs[path][0].at):
        if groups and logs[log][0].at < end:
            groups[-1].append(log)
        else:
            groups.append([log])
            end = float("-inf")
        end = max(end, logs[log][-1].at)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args()
    logs: dict[Path, list[State]] = {}
    for log in args.logs:
        states = parse(log.read_text().splitlines())
        if len(states) < 2:
            print(f"{log}: too few states")
            continue
        logs[log] = states
        seconds = seconds_by_state(states)
        cells = ", ".join(f"{name} {seconds[name]:.1f} s" for name in (
            "running, none waiting", "waiting beside running", "waiting, none running", "idle"))
        print(f"{log}: {states[-1].at - states[0].at:.1f} s traced: {cells}; "
              f"{sum(1 for s in states if s.deferred)} states with a deferred lookup, "
              f"{sum(1 for s in states if s.preempted)} with a preempted request")
    for group in runs(logs):
        if len(group) > 1:
            seconds_waiting = waiting_beside_idle([logs[log] for log in group])
            print(f"run of {', '.join(log.name for log in group)}: one engine had a request "
                  f"waiting while another was idle for {seconds_waiting:.1f} s")


if __name__ == "__main__":
    main()
