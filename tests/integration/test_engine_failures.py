"""A failed engine start reports the engine's own last log lines and leaves no process behind."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import psutil
import pytest

from turnkv_server.launcher import Cluster, ClusterConfig, EngineStartError


def _processes_started_under(run_dir: Path) -> list[psutil.Process]:
    """Processes whose command line or working directory points into the run folder."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            where = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["cwd"] or "")
        except psutil.Error:
            continue
        if str(run_dir) in where:
            found.append(proc)
    return found


def _assert_failed_cleanly(cluster: Cluster, error: EngineStartError, run_dir: Path) -> None:
    engine = cluster.engines[0]
    assert engine.ref is not None
    assert not engine.ref.is_alive()
    assert _processes_started_under(run_dir) == []
    assert error.log_tail.strip(), "the error must carry the engine's log"
    assert str(error.log_path) in str(error)


def test_unloadable_model_reports_log_and_leaves_nothing(tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").unlink()  # config and tokenizer load, weights do not
    run_dir = tmp_path / "run"
    cluster = Cluster(ClusterConfig(mode="single", model=str(broken), dtype="float32",
                                    run_dir=run_dir))
    with pytest.raises(EngineStartError) as info:
        cluster.start()
    print(info.value)
    assert "process exited" in info.value.reason
    assert info.value.root_cause is not None
    assert "model weights" in info.value.root_cause
    assert info.value.root_cause in str(info.value)
    _assert_failed_cleanly(cluster, info.value, run_dir)


def test_taken_port_reports_log_and_leaves_nothing(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        run_dir = tmp_path / "run"
        cluster = Cluster(ClusterConfig(mode="single", model=str(tiny_model), dtype="float32",
                                        engine_ports=[port], run_dir=run_dir))
        with pytest.raises(EngineStartError) as info:
            cluster.start()
    print(info.value)
    assert "address already in use" in str(info.value).lower()
    _assert_failed_cleanly(cluster, info.value, run_dir)
