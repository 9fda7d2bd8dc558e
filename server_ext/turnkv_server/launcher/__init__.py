"""Start, inspect and stop local clusters of vLLM engines."""

from __future__ import annotations

from pathlib import Path

from turnkv_server.launcher.cluster import Cluster, ClusterStartError, stop_cluster
from turnkv_server.launcher.config import MODES, ClusterConfig
from turnkv_server.launcher.engine import EngineSpec, EngineStartError
from turnkv_server.launcher.processes import ProcessRef
from turnkv_server.launcher.state import ClusterState, current_run_dir


def load_state(run_dir: Path) -> ClusterState | None:
    try:
        return ClusterState.load(run_dir)
    except (OSError, ValueError):
        return None


def current_state() -> ClusterState | None:
    """The cluster `turnkv up` started last, if any of its processes still runs."""
    run_dir = current_run_dir()
    state = load_state(run_dir) if run_dir else None
    if state is None:
        return None
    servers = state.engines + ([state.router_process] if state.router_process else [])
    if not any(ProcessRef(pid=s.pid, create_time=s.create_time).is_alive() for s in servers):
        return None
    return state


__all__ = [
    "MODES",
    "Cluster",
    "ClusterConfig",
    "ClusterStartError",
    "ClusterState",
    "EngineSpec",
    "EngineStartError",
    "ProcessRef",
    "current_state",
    "load_state",
    "stop_cluster",
]
