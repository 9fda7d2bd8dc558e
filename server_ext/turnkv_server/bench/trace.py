"""Traces: workloads as JSONL files, to replay user traffic or pin a generated workload.

One JSON object per line. The first line may be a header naming the workload; every other line
is one session with all its turns (see docs/benchmarks.md, "Trace format"). Errors name the
file and line, so a hand-written trace is easy to fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnkv_server.bench.workloads import SessionSpec, Workload

TRACE_VERSION: Literal[1] = 1

M = TypeVar("M", bound=BaseModel)


class TraceError(ValueError):
    """A trace file that cannot be read as a workload; the message names the line."""


class TraceHeader(BaseModel):
    """The optional first line: the workload's name, seed, kind and closed-loop concurrency."""

    model_config = ConfigDict(extra="forbid")

    trace: Literal["turnkv"]
    version: Literal[1]
    name: str
    seed: int = 0
    kind: Literal["agent", "chat", "trace"] = "trace"
    concurrency: int | None = Field(default=None, ge=1)


def write_trace(workload: Workload, path: Path) -> None:
    """Write `workload` as a trace that `load_trace` reads back equal."""
    header = TraceHeader(trace="turnkv", version=TRACE_VERSION, name=workload.name,
                         seed=workload.seed, kind=workload.kind,
                         concurrency=workload.concurrency)
    lines = [header.model_dump_json()]
    lines += [s.model_dump_json() for s in workload.sessions]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_trace(path: Path) -> Workload:
    """The workload in trace file `path`; without a header it is an open-loop trace named
    after the file, sessions starting at their `start_s`."""
    header: TraceHeader | None = None
    sessions: list[SessionSpec] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            obj = _parse(path, number, line)
            if "trace" in obj:
                if sessions or header is not None:
                    raise TraceError(f"{path}:{number}: a header must be the first line")
                header = _validate(TraceHeader, obj, path, number)
            else:
                sessions.append(_validate(SessionSpec, obj, path, number))
    if not sessions:
        raise TraceError(f"{path}: no sessions")
    if header is None:
        header = TraceHeader(trace="turnkv", version=TRACE_VERSION, name=path.stem)
    try:
        return Workload(name=header.name, seed=header.seed, kind=header.kind,
                        sessions=sessions, concurrency=header.concurrency)
    except ValidationError as e:
        raise TraceError(f"{path}: {_errors(e)}") from None


def _parse(path: Path, number: int, line: str) -> dict[str, object]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}:{number}: not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _validate(model: type[M], obj: dict[str, object], path: Path, number: int) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise TraceError(f"{path}:{number}: {_errors(e)}") from None


def _errors(e: ValidationError) -> str:
    # "turns.2.max_tokens: Input should be greater than or equal to 1; ..."
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)
