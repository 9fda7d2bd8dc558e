"""The record of a measuring run (scripts/fuzz_router.py, scripts/soak.py): where its processes'
logs went, what was measured, and what the logs say.

A run is not a test: nothing is asserted, everything is written down, with the exact command
and the commit, so that a figure in docs/reliability.md can be traced to its run.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from turnkv_server.paths import turnkv_home

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "docs" / "reliability"
# A line that says something failed, in a vLLM, uvicorn or router log.
ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|\bCRITICAL\b")


def revision() -> str:
    """The commit measured, and whether the working tree had changes on top of it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+uncommitted changes" if dirty else head


def new_run_dir(kind: str) -> Path:
    """A run folder of the launcher's kind (engine logs, sockets, Redis), kept after the run
    for its logs."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = turnkv_home() / "runs" / f"reliability-{kind}-{stamp}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def shown(run_dir: Path) -> str:
    """A run folder as the JSON records it: under $TURNKV_HOME, whoever's home that is."""
    return str(run_dir).replace(str(turnkv_home()), "$TURNKV_HOME", 1)


def header(command: str, started: float, run_dir: Path) -> dict[str, Any]:
    """What every record starts with: the command (every option spelt out, defaults too: what
    reruns it), the commit, when, where, on what."""
    return {"command": command, "revision": revision(),
            "when": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(),
                        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
            "run_dir": shown(run_dir)}


def scan_logs(run_dir: Path, secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per log of the run: error lines (counted, the first few kept) and whether it holds
    any of `secrets` (a key or the prompt marker; only the fact is reported)."""
    report: dict[str, Any] = {}
    for log in sorted(run_dir.glob("**/*.log")):
        text = log.read_text(errors="replace")
        errors = [line.strip()[:300] for line in text.splitlines() if ERROR_LINE.search(line)]
        report[str(log.relative_to(run_dir))] = {
            "error_lines": len(errors), "first_error_lines": errors[:8],
            "holds_a_secret": any(s in text for s in secrets)}
    return report


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {name: getattr(value, name) for name in value.__dataclass_fields__}
    raise TypeError(f"not JSON: {value!r}")


def percentiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=100)
    return {"p50": round(statistics.median(values), 3), "p90": round(q[89], 3),
            "p99": round(q[98], 3), "max": round(max(values), 3)}


def missed_goals(goals: dict[str, object]) -> list[str]:
    """The goals (what a run must not have -> what it had) that were missed."""
    return [goal for goal, had in goals.items() if had]
