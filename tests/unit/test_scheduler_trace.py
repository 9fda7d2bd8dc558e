"""scripts/scheduler_trace: the trace on vLLM's own scheduler (`engine_scheduler`), and its
summary.

The trace's figures are docs/benchmarks.md's (the planner under pressure).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from vllm.v1.core.sched import scheduler as vllm_scheduler

from tests.unit.engine_scheduler import BLOCK, DeferredTier, EngineScheduler

FOLDER = Path(__file__).resolve().parents[2] / "scripts" / "scheduler_trace"
sys.path.insert(0, str(FOLDER))
import summarize  # noqa: E402


def _load_trace() -> ModuleType:
    # By its path: the name `sitecustomize` is taken by the interpreter's own, if it has one.
    spec = importlib.util.spec_from_file_location("scheduler_trace", FOLDER / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trace = _load_trace()


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """vLLM's scheduler traced into a log under tmp_path, untraced again after the test."""
    monkeypatch.setattr(vllm_scheduler.Scheduler, "schedule",
                        vllm_scheduler.Scheduler.schedule)
    folder = tmp_path / "trace"
    folder.mkdir()
    trace._patch(vllm_scheduler, trace._Trace(str(folder)))
    DeferredTier.deferring = False
    yield folder
    DeferredTier.deferring = False


def test_the_trace_tells_a_deferred_lookup_from_a_request_that_runs(
        tmp_path: Path, traced: Path) -> None:
    engine = EngineScheduler(tmp_path / "model", blocks=32, tier=True)
    DeferredTier.deferring = True
    engine.add("w", list(range(100, 100 + 4 * BLOCK)))
    for _ in range(3):
        assert engine.step().total_num_scheduled_tokens == 0
    DeferredTier.deferring = False
    engine.run_until_finished("w")
    engine.step()  # nothing left

    (log,) = traced.glob("sched-*.log")
    states = summarize.parse(log.read_text().splitlines())
    # One line per change: deferred and waiting, then running, then idle.
    assert [(s.running, s.waiting, s.deferred) for s in states] == [
        (0, 1, 1), (1, 0, 0), (0, 0, 0)]
    seconds = summarize.seconds_by_state(states)
    assert set(seconds) == {"waiting, none running", "running, none waiting"}


def test_the_summary_counts_each_state_until_the_next() -> None:
    lines = [
        "10.000 running=1 waiting=0 scheduled=5 waiting_states=- deferred=0 free_blocks=9",
        "trace error: ValueError()",
        "12.000 running=1 waiting=1 scheduled=1 waiting_states=WAITING deferred=0 free_blocks=0",
        "15.500 running=0 waiting=2 scheduled=0 waiting_states=PREEMPTED,WAITING deferred=0 "
        "free_blocks=3",
        "16.000 running=0 waiting=0 scheduled=0 waiting_states=- deferred=0 free_blocks=9",
        "20.000 running=2 waiting=0 scheduled=2 waiting_states=- deferred=0 free_blocks=1",
    ]
    states = summarize.parse(lines)
    assert [s.preempted for s in states] == [False, False, True, False, False]
    assert summarize.seconds_by_state(states) == {
        "running, none waiting": 2.0, "waiting beside running": 3.5,
        "waiting, none running": 0.5, "idle": 4.0}


def line(at: float, running: int, waiting: int) -> str:
    return (f"{at:.3f} running={running} waiting={waiting} scheduled={running} "
            f"waiting_states={'WAITING' if waiting else '-'} deferred=0 free_blocks=0")


def test_a_wait_counts_where_another_engine_of_its_run_is_idle() -> None:
    busy = summarize.parse([line(0, 1, 0), line(2, 1, 1), line(5, 1, 0), line(9, 0, 0)])
    quiet = summarize.parse([line(1, 0, 0), line(3, 1, 0), line(4, 0, 0), line(8, 1, 0)])
    later = summarize.parse([line(20, 1, 1), line(30, 0, 0)])
    # Waiting 2-5 s on the first engine; the second idle 1-3 and 4-8 s: 1 s + 1 s.
    assert summarize.waiting_beside_idle([busy, quiet]) == pytest.approx(2.0)
    logs = {Path("a"): busy, Path("b"): quiet, Path("c"): later}
    assert summarize.runs(logs) == [[Path("a"), Path("b")], [Path("c")]]
