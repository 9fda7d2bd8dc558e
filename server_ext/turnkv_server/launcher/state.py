"""The state file of a running cluster: what `turnkv status` shows and `turnkv down` stops."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from turnkv_server.paths import turnkv_home

STATE_FILE = "state.json"


class ServerState(BaseModel):
    name: str
    role: str
    url: str
    pid: int
    create_time: float
    cores: list[int] = []
    nixl_port: int | None = None
    log: str
    # Its KV connector's engine ID (None: it loads none): what names its host tier's region.
    engine_id: str | None = None
    # Its processes' multiprocessing files in /dev/shm, which a killed engine leaves behind.
    shared_memory: list[str] = []


class ClusterState(BaseModel):
    mode: str
    model: str
    served_model_name: str
    run_dir: str
    router: str
    engines: list[ServerState]
    router_process: ServerState | None = None

    def endpoints(self) -> dict[str, object]:
        return {
            "router": self.router,
            "model": self.served_model_name,
            "mode": self.mode,
            "prefill": [e.url for e in self.engines if e.role == "prefill"],
            "decode": [e.url for e in self.engines if e.role == "decode"],
            "single": [e.url for e in self.engines if e.role == "single"],
            "engine": [e.url for e in self.engines if e.role == "engine"],
            "run_dir": self.run_dir,
        }

    def save(self) -> Path:
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, run_dir: Path) -> ClusterState:
        return cls.model_validate_json((run_dir / STATE_FILE).read_text())


def current_pointer() -> Path:
    """Where `turnkv up` records the run folder of the cluster it started last."""
    return turnkv_home() / "current-cluster.json"


def set_current(run_dir: Path) -> None:
    pointer = current_pointer()
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(json.dumps({"run_dir": str(run_dir)}))


def current_run_dir() -> Path | None:
    try:
        return Path(json.loads(current_pointer().read_text())["run_dir"])
    except (OSError, ValueError, KeyError):
        return None


def clear_current(run_dir: Path) -> None:
    if current_run_dir() == run_dir:
        current_pointer().unlink(missing_ok=True)
