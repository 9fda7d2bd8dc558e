"""Trace vLLM's scheduler: how long its requests wait, and with what running beside them.

A diagnostic, not part of turnkv. Python imports `sitecustomize` from its path at start-up: with
this folder on PYTHONPATH and TURNKV_SCHEDULER_TRACE naming a folder, every vLLM engine core
started from that environment writes `sched-<pid>.log` there, a line each time its scheduler's
state changes after a step: the time, the requests running and waiting, the tokens the step
scheduled, the waiting requests' states, how many of them the KV connector deferred (its lookup
answered "not yet") and the free KV blocks. Nothing is patched until vLLM's scheduler module is
imported, so other processes (the router, the bench) only pay for the check.

    PYTHONPATH=scripts/scheduler_trace:$PYTHONPATH TURNKV_SCHEDULER_TRACE=/tmp/trace \\
        turnkv bench --workload agent-pressure --modes turnkv,bound --repeat 1
    python scripts/scheduler_trace/summarize.py /tmp/trace/*.log

A failure of the trace is written to its log and never reaches the engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from types import ModuleType
from typing import Any

TRACE_DIR = os.environ.get("TURNKV_SCHEDULER_TRACE")
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


class _Trace:
    def __init__(self, folder: str) -> None:
        self._path = os.path.join(folder, f"sched-{os.getpid()}.log")
        self._file: Any = None
        self._last: tuple[Any, ...] | None = None
        self.deferred = 0

    def write(self, line: str) -> None:
        if self._file is None:
            self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 (the process's life)
        self._file.write(line + "\n")

    def record(self, scheduler: Any, output: Any) -> None:
        waiting = sorted(str(r.status).rsplit(".", 1)[-1] for r in scheduler.waiting)
        scheduled = output.total_num_scheduled_tokens
        state = (len(scheduler.running), len(waiting), scheduled > 0, tuple(waiting),
                 self.deferred > 0)
        if state == self._last:
            return
        self._last = state
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.write(f"{time.time():.3f} running={state[0]} waiting={state[1]} "
                   f"scheduled={scheduled} waiting_states={','.join(waiting) or '-'} "
                   f"deferred={self.deferred} free_blocks={free}")


def _patch(module: ModuleType, trace: _Trace) -> None:
    scheduler_class = module.Scheduler
    schedule = scheduler_class.schedule

    def traced_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        connector = getattr(self, "connector", None)
        if connector is not None and not getattr(connector, "_traced", False):
            lookup = connector.get_num_new_matched_tokens

            def traced_lookup(*a: Any, **k: Any) -> Any:
                found = lookup(*a, **k)
                if found[0] is None:
                    trace.deferred += 1
                return found

            connector.get_num_new_matched_tokens = traced_lookup
            connector._traced = True
        trace.deferred = 0
        output = schedule(self, *args, **kwargs)
        try:
            trace.record(self, output)
        except Exception as exc:  # the trace must never stop the engine
            trace.write(f"trace error: {exc!r}")
        return output

    scheduler_class.schedule = traced_schedule


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the scheduler module once Python has executed it."""

    def __init__(self, trace: _Trace) -> None:
        self._trace = trace

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != SCHEDULER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, trace = spec.loader, self._trace
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            try:
                _patch(module, trace)
            except Exception as exc:
                trace.write(f"trace error: {exc!r}")

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if TRACE_DIR:
    sys.meta_path.insert(0, _PatchOnImport(_Trace(TRACE_DIR)))
