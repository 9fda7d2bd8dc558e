"""Reliability at scale, measured: the router's HTTP API fuzzed for many cases, and a soak of
many concurrent sessions while engines and a router are killed and restarted.

    python scripts/reliability.py fuzz [--cases 10000]          # -> docs/reliability/fuzz.json
    python scripts/reliability.py soak [--minutes 10] [--sessions 64]
                                       # -> docs/reliability/soak.json, docs/reliability/memory.png

Both start their own local `turnkv` cluster of the tiny model (float32) and stop every process
they started when they end, however they end. Neither asserts: they measure and write what
they saw, and exit 1 if a goal was missed (an answer at 500 or above, a lost turn, a block
left pinned). docs/reliability.md says what each figure means, and the figures of a run.

`fuzz`: the router runs with two tenants and an admin key, as in
tests/integration/test_router_security.py, and gets cases drawn with hypothesis from the same
strategies (tests/support/router_fuzz.py), split evenly over the four kinds of case, seeded.
Recorded: cases and requests per kind, statuses, every answer at 500 or above with the request
that caused it (without its key), answers that broke the API's other promises, memory of each
process every few hundred cases, whether the engines are healthy after, and the KV blocks
still pinned or in use once the leases' TTL has passed.

`soak`: KV caches small enough that the sessions' leases press the pin cap, two routers
sharing Redis, S sessions at once of T turns each, each turn through the other router than the
one before. Every turn's output is checked against a single engine's greedy output for the
same conversation (tests/support/oracle.py). During the run the decode engine, the prefill
engine and the launcher's router are each killed with SIGKILL once and started again. A turn
that fails is retried as the SDK retries (Retry-After, else backoff), within a time budget.
Memory of every process and each engine's pinned blocks are sampled every few seconds; at the
end the leftover sessions are released, the leases' TTL is waited out and every engine's
pinned and used blocks are read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from hypothesis import HealthCheck, Phase, given, seed, settings
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Run as `python scripts/reliability.py`, Python puts scripts/ on the path, not the repository:
# the fuzz strategies, the oracle and the Redis helper are the tests' own (tests/support).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.oracle import Completion, compare, greedy_chat  # noqa: E402
from tests.support.redis_server import redis_server  # noqa: E402
from tests.support.router_fuzz import (  # noqa: E402
    ADMIN_KEY,
    KEY_A,
    KEYS,
    KINDS,
    MARKER,
    Answer,
    Request,
    auth,
    fetch,
    problem,
)
from turnkv_server.engine.metrics import fetch_connector_counters  # noqa: E402
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState  # noqa: E402
from turnkv_server.launcher.engine import EngineProcess  # noqa: E402
from turnkv_server.launcher.processes import group_members  # noqa: E402
from turnkv_server.paths import turnkv_home  # noqa: E402
from turnkv_server.ports import PortHold, read_report  # noqa: E402

OUT_DIR = REPO / "docs" / "reliability"
# The tiny model's KV takes 2,048 bytes a token in float32, 128 tokens a block.
BLOCK_BYTES = 128 * 2048

# -- shared ----------------------------------------------------------------------------------


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
    home = str(turnkv_home())
    return str(run_dir).replace(home, "$TURNKV_HOME", 1)


def group_rss_mib(pid: int) -> float | None:
    """Resident memory of a process group (an engine's API server, core and helpers; a
    router), in MiB; None if nothing of it is alive. (RSS counts pages shared between the
    group's processes once per process: an upper bound, but a leak shows all the same.)"""
    total, alive = 0, False
    for process in group_members(pid):
        try:
            total += process.memory_info().rss
            alive = True
        except psutil.Error:
            continue
    return total / 2**20 if alive else None


def process_rss_mib(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def counters(url: str) -> dict[str, float] | None:
    """An engine's turnkv counters and KV usage; None while it does not answer."""
    try:
        return fetch_connector_counters(url, timeout=5.0)
    except (httpx.HTTPError, ValueError):
        return None


def kv_state(urls: dict[str, str]) -> dict[str, dict[str, float | None]]:
    """Per engine: blocks pinned under leases, live leases, and the share of the KV cache in
    use (vLLM's `kv_cache_usage_perc`, 0 to 1) with the blocks that share stands for."""
    out: dict[str, dict[str, float | None]] = {}
    for name, url in urls.items():
        values = counters(url)
        if values is None:
            out[name] = {"pinned_blocks": None, "leases": None, "kv_cache_usage": None,
                         "blocks_in_use": None}
            continue
        usable = values.get("num_gpu_blocks", 1.0) - 1  # vLLM keeps its null block back
        usage = values.get("kv_cache_usage", 0.0)
        out[name] = {"pinned_blocks": values.get("pinned_blocks", 0.0),
                     "leases": values.get("leases", 0.0), "kv_cache_usage": usage,
                     "blocks_in_use": round(usage * usable)}
    return out


def is_clear(state: dict[str, dict[str, float | None]]) -> bool:
    return all(v["pinned_blocks"] == 0 and v["kv_cache_usage"] == 0 for v in state.values())


@dataclass
class Clearing:
    """How the engines' pinned and used blocks went down while nothing was sent."""

    seconds: float | None  # until every engine had none; None: not within the timeout
    last: dict[str, dict[str, float | None]]
    # (seconds, engine -> (pinned, in use)) at each change
    steps: list[tuple[float, dict[str, tuple[float | None, float | None]]]]


def wait_until_clear(urls: dict[str, str], timeout: float, poll: float = 1.0) -> Clearing:
    """Poll the engines, sending nothing, until no block is pinned or in use."""
    start = time.monotonic()
    steps: list[tuple[float, dict[str, tuple[float | None, float | None]]]] = []
    while True:
        state = kv_state(urls)
        now = round(time.monotonic() - start, 1)
        reading = {n: (v["pinned_blocks"], v["blocks_in_use"]) for n, v in state.items()}
        if not steps or steps[-1][1] != reading:
            steps.append((now, reading))
        if is_clear(state):
            return Clearing(now, state, steps)
        if now > timeout:
            return Clearing(None, state, steps)
        time.sleep(poll)


# A line that says something failed, in a vLLM, uvicorn or router log.
ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|\bCRITICAL\b")


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
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def percentiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=100)
    return {"p50": round(statistics.median(values), 3), "p90": round(q[89], 3),
            "p99": round(q[98], 3), "max": round(max(values), 3)}


# -- fuzz ------------------------------------------------------------------------------------

# A turn's engine lease without a TTL hint; fuzzed hints ask for up to 600 s, which the
# engines cap at FUZZ_MAX_LEASE_S (the operator's cap), so that every lease is over soon after
# the last case and what is left pinned then is a leak.
FUZZ_LEASE_S = 3.0
FUZZ_MAX_LEASE_S = 10.0
# Memory and health are sampled every this many cases.
FUZZ_SAMPLE_EVERY = 250
# A fuzzed answer that takes longer than this is recorded as a hang: a valid case (two tokens
# of the tiny model at most) is answered within a second here, and the connector's own
# timeouts (60 s to send, 120 s to receive) would otherwise set the pace of the run.
FUZZ_TIMEOUT_S = 30.0
# Answers slower than this are listed (with their requests).
FUZZ_SLOW_S = 5.0


class RouterDown(Exception):
    """The router stopped answering: the rest of the cases would measure nothing."""


@dataclass
class FuzzTally:
    cases: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    server_errors: list[dict[str, Any]] = field(default_factory=list)  # answers >= 500
    other_problems: list[dict[str, Any]] = field(default_factory=list)
    no_answer: list[dict[str, Any]] = field(default_factory=list)  # transport errors, hangs
    slow: list[dict[str, Any]] = field(default_factory=list)  # answered, after FUZZ_SLOW_S
    seconds: list[float] = field(default_factory=list)  # each answer's
    samples: list[dict[str, Any]] = field(default_factory=list)

    def record(self, kind: str, request: Request, answer: Answer | None,
               error: str | None, seconds: float) -> None:
        self.requests[kind] += 1
        if answer is None:
            self.no_answer.append({"kind": kind, "request": request.describe(),
                                   "error": error, "seconds": round(seconds, 1)})
            return
        self.seconds.append(seconds)
        if seconds > FUZZ_SLOW_S:
            self.slow.append({"kind": kind, "request": request.describe(),
                              "status": answer.status, "seconds": round(seconds, 1)})
        self.statuses.setdefault(kind, Counter())[answer.status] += 1
        wrong = problem(request, answer)
        if wrong is None:
            return
        entry = {"kind": kind, "request": request.describe(), "status": answer.status,
                 "answer": answer.text[:1000], "problem": wrong}
        (self.server_errors if answer.status >= 500 else self.other_problems).append(entry)

    def by_class(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for statuses in self.statuses.values():
            for status, n in statuses.items():
                total[f"{status // 100}xx"] += n
        return total


# The ID of an engine request in its answer: its transfer's ID, which the engines' logs name.
ANSWER_ID = re.compile(r'"id"\s*:\s*"([^"]+)"')


class FuzzRun:
    """The cases of one run against one cluster, with a live progress line. Every request
    and its answer's status go to `log` (JSON lines, in the run folder, with the answer's
    ID, which the engines' log lines name): what to look up when an engine logs a problem."""

    def __init__(self, state: ClusterState, client: httpx.Client, total: int,
                 progress: Progress, log: Path) -> None:
        self.state, self.client, self.progress = state, client, progress
        self.log = open(log, "a")  # noqa: SIM115 (closed by `close`, after the last case)
        self.tally = FuzzTally()
        self.done = 0
        self.started = time.monotonic()
        self.task = progress.add_task("fuzz", total=total, line="")
        self.pids = {**{e.name: e.pid for e in state.engines},
                     **({"router": state.router_process.pid} if state.router_process else {})}

    def case(self, kind: str) -> Callable[..., None]:
        """The body of a hypothesis test for `kind`: one case, recorded, never failing (a
        wrong answer is a finding to count, not a falsifying example to shrink)."""
        def one_case(**drawn: Any) -> None:
            for request in KINDS[kind].build(self.state.served_model_name, **drawn):
                sent = time.monotonic()
                try:
                    answer: Answer | None = fetch(self.client, self.state.router, request)
                    error = None
                except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL) as exc:
                    answer, error = None, f"{type(exc).__name__}: {exc}"
                self.tally.record(kind, request, answer, error, time.monotonic() - sent)
                found = ANSWER_ID.search(answer.text) if answer is not None else None
                self.log.write(json.dumps({
                    "at": datetime.now().isoformat(timespec="milliseconds"), "kind": kind,
                    "request": request.describe(),
                    "status": answer.status if answer is not None else error,
                    "id": found.group(1) if found else None}) + "\n")
            self.tally.cases[kind] += 1
            self.done += 1
            if self.done % FUZZ_SAMPLE_EVERY == 0:
                self.sample()
            self.show(kind)
        return one_case

    def close(self) -> None:
        self.log.close()

    def show(self, kind: str) -> None:
        tally = self.tally
        classes = " ".join(f"{c}:{n}" for c, n in sorted(tally.by_class().items()))
        self.progress.update(self.task, advance=1, description=f"fuzz {kind}", line=(
            f"{self.done / max(time.monotonic() - self.started, 1e-9):.1f} cases/s  {classes}"
            f"  >=500: {len(tally.server_errors)}  other problems: "
            f"{len(tally.other_problems)}  no answer: {len(tally.no_answer)}"))

    def sample(self) -> None:
        """Memory of each process group, the engines' health as the router sees it, and the
        router's live sessions; raises RouterDown if the router does not answer."""
        try:
            stats = self.client.get(f"{self.state.router}/v1/turnkv/stats",
                                    headers=auth(ADMIN_KEY), timeout=10).json()
            healthy = {e["name"]: e["healthy"] for e in stats["engines"]}
            sessions = stats["sessions"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise RouterDown(f"after {self.done} cases the router's stats failed: {exc!r}"
                             ) from exc
        self.tally.samples.append({
            "t_s": round(time.monotonic() - self.started, 1), "cases": self.done,
            "rss_mib": {name: _round(group_rss_mib(pid)) for name, pid in self.pids.items()},
            "engines_healthy": healthy, "router_sessions": sessions})


def fuzz(args: argparse.Namespace, console: Console) -> int:
    run_dir = new_run_dir("fuzz")
    keys_file = run_dir / "api-keys.json"
    keys_file.write_text(json.dumps(KEYS))
    config = ClusterConfig(
        mode="turnkv", model="tiny", dtype="float32", run_dir=run_dir,
        router_args=("--api-keys", str(keys_file), "--admin-key", ADMIN_KEY),
        connector_settings={"lease_ttl_s": FUZZ_LEASE_S, "lease_max_ttl_s": FUZZ_MAX_LEASE_S})
    console.print(f"fuzz: {args.cases} cases, seed {args.seed}; run folder {run_dir}")
    started, measured = time.time(), revision()
    aborted: str | None = None
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[line]}"))
    with Cluster(config, console=console) as state, \
            httpx.Client(timeout=FUZZ_TIMEOUT_S) as client, \
            Progress(*columns, console=console) as progress:
        engines = {e.name: e.url for e in state.engines}
        run = FuzzRun(state, client, args.cases, progress, run_dir / "cases.jsonl")
        run.sample()
        split = [args.cases // len(KINDS) + (i < args.cases % len(KINDS))
                 for i in range(len(KINDS))]
        for index, ((kind, case), count) in enumerate(zip(KINDS.items(), split, strict=True)):
            # Only the generate phase: nothing fails here, so there is nothing to shrink, and
            # no example database is read or written. Seeded: a rerun draws the same cases.
            test = settings(max_examples=count, deadline=None, database=None,
                            derandomize=False, phases=[Phase.generate], print_blob=False,
                            suppress_health_check=list(HealthCheck))(
                seed(args.seed + index)(given(**case.strategies)(run.case(kind))))
            try:
                test()
            except RouterDown as exc:
                aborted = str(exc)
                break
        fuzz_s = time.monotonic() - run.started
        run.close()
        if aborted is None:
            run.sample()
        progress.stop()
        console.print(f"{run.done} cases in {fuzz_s:.0f} s; checking the cluster")
        after = fuzz_aftermath(client, state, engines)
    tally, done = run.tally, run.done
    findings = scan_logs(run_dir, (*KEYS, ADMIN_KEY, MARKER))
    classes = tally.by_class()
    result = {
        "command": f"python scripts/reliability.py fuzz --cases {args.cases} --seed {args.seed}",
        "revision": measured,
        "when": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "memory_gib": round(
            psutil.virtual_memory().total / 2**30, 1)},
        "cluster": {"mode": "turnkv", "model": "tiny (float32)", "engines": list(engines),
                    "lease_ttl_s": FUZZ_LEASE_S, "lease_max_ttl_s": FUZZ_MAX_LEASE_S},
        "run_dir": shown(run_dir),
        "aborted": aborted,
        "seconds": round(fuzz_s, 1),
        "cases_per_s": round(done / max(fuzz_s, 1e-9), 2),
        "cases": dict(tally.cases), "cases_total": done,
        "requests": dict(tally.requests), "requests_total": sum(tally.requests.values()),
        "statuses": {kind: {str(s): n for s, n in sorted(c.items())}
                     for kind, c in tally.statuses.items()},
        "status_classes": dict(sorted(classes.items())),
        "answers_500_or_above": len(tally.server_errors),
        "server_errors": tally.server_errors[:100],
        "other_problems_count": len(tally.other_problems),
        "other_problems": tally.other_problems[:100],
        "no_answer_count": len(tally.no_answer),
        "no_answer": tally.no_answer[:100],
        "answer_seconds": percentiles(tally.seconds),
        "slow_count": len(tally.slow),
        "slow": tally.slow[:100],
        "samples": tally.samples,
        "after": after,
        "logs": findings,
    }
    out = Path(args.out)
    write_json(out, result)
    console.print(f"wrote {out}")
    missed = [goal for goal, failed in (
        ("answers at 500 or above", tally.server_errors),
        ("answers that broke another promise", tally.other_problems),
        ("requests without an answer", tally.no_answer),
        ("a run cut short", aborted),
        ("engines unhealthy after", not after["engines_healthy"]),
        ("blocks left pinned or in use", not after["clear_idle"]),
        ("a log holding a key or a prompt", any(v["holds_a_secret"] for v in findings.values())),
    ) if failed]
    console.print(f"cases {done}; statuses {dict(sorted(classes.items()))}; "
                  f">=500: {len(tally.server_errors)}; after: {after['kv_idle']}")
    if missed:
        console.print(f"[red]missed: {', '.join(missed)}[/]")
    return 1 if missed else 0


def fuzz_aftermath(client: httpx.Client, state: ClusterState, engines: dict[str, str]
                   ) -> dict[str, Any]:
    """Is the cluster still well once the fuzzing is over, and is every block free again
    once the leases' TTL has passed (first without a request, then after one)?"""
    admin = auth(ADMIN_KEY)
    deadline = time.monotonic() + 30
    while True:
        stats = client.get(f"{state.router}/v1/turnkv/stats", headers=admin).json()
        in_flight = {e["name"]: e["in_flight"] for e in stats["engines"]}
        if not any(in_flight.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    healthy = {e["name"]: e["healthy"] for e in stats["engines"]}
    body = {"model": state.served_model_name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"{MARKER} still there?"}]}
    still = client.post(f"{state.router}/v1/chat/completions", json=body,
                        headers=auth(KEY_A)).status_code
    # That turn's own lease, and the fuzzed ones, end within the operator's cap: wait it out
    # without sending anything (an idle engine must expire its leases on its own).
    time.sleep(FUZZ_MAX_LEASE_S)
    idle = wait_until_clear(engines, timeout=120)
    ticked: Clearing | None = None
    if idle.seconds is None:
        # Only then: one request, which makes a lazy expiry run, to tell a leak from a late
        # expiry.
        client.post(f"{state.router}/v1/chat/completions", json=body, headers=auth(KEY_A))
        time.sleep(FUZZ_LEASE_S + 1)
        ticked = wait_until_clear(engines, timeout=30)
    return {"in_flight": in_flight, "engines_healthy": all(healthy.values()),
            "healthy": healthy, "a_valid_turn_after": still,
            "waited_s": FUZZ_MAX_LEASE_S, **clearing_report(idle, ticked)}


def clearing_report(idle: Clearing, ticked: Clearing | None) -> dict[str, Any]:
    return {"clear_idle": idle.seconds is not None,
            "clear_idle_after_s": idle.seconds, "kv_idle": idle.last,
            "kv_idle_steps": idle.steps,
            "clear_after_a_request": None if ticked is None else ticked.seconds is not None,
            "kv_after_a_request": None if ticked is None else ticked.last}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# -- soak ------------------------------------------------------------------------------------

# Blocks in each engine's KV cache: the connector's pin cap is half of them (64), which 64
# live sessions of a few blocks each press against (as in tests/integration/test_load.py).
SOAK_BLOCKS = 128
SOAK_MAX_TOKENS = 8
# Engine leases: a session's blocks stay pinned this long after its last turn, unless `final`
# (or DELETE) releases them; short, so that the end of the run can wait them out.
SOAK_LEASE_S = 30.0
SOAK_MAX_LEASE_S = 60.0
# A hung engine fails its turn after this long without a byte (the router's default is 600 s).
SOAK_READ_TIMEOUT_S = 60.0
# The client's own timeout per attempt; longer than the router's read timeout.
SOAK_CLIENT_TIMEOUT_S = 180.0
SOAK_SAMPLE_S = 5.0
# When in the run each fault comes, as a share of its length.
FAULTS = (("decode engine", 0.2), ("prefill engine", 0.45), ("router-1", 0.7))
# The SDK's retry policy (turnkv.retry.RetryPolicy): Retry-After up to 30 s, else 0.5 s
# doubling up to 8 s; 429, 503 and connection errors. Attempts are bounded by time here, not
# by the SDK's default of three: an engine restart on this machine takes longer than three
# attempts wait.
RETRY_STATUSES = (429, 503)
RETRY_INITIAL_S = 0.5
RETRY_MAX_WAIT_S = 8.0
RETRY_MAX_AFTER_S = 30.0
SYSTEM = "You are a terse assistant in a reliability soak. Answer briefly."
TOPICS = ("the weather on the coast", "a list of three colours", "how a lock works",
          "why the sky is blue", "a short poem about rust", "the rules of chess",
          "the boiling point of water", "a name for a cat", "how trains brake",
          "what a prime number is")


@dataclass
class Script:
    """One conversation: the messages of each turn (with the reference's replies as the
    assistant's turns) and the single engine's greedy output for each turn."""

    messages: list[list[dict[str, Any]]]
    expected: list[Completion]


def script_user_turns(index: int, turns: int) -> list[str]:
    rng = random.Random(index)
    return [f"Conversation {index}, turn {t + 1}: tell me about {rng.choice(TOPICS)}."
            for t in range(turns)]


def reference_scripts(count: int, turns: int, console: Console, run_dir: Path
                      ) -> list[Script]:
    """Every script's turns on one engine with prefix caching (`single` mode): the output
    every routed turn must equal, token by token (near-ties allowed: tests/support/oracle)."""
    config = ClusterConfig(mode="single", model="tiny", dtype="float32",
                           run_dir=run_dir / "reference")
    scripts = []
    with Cluster(config, console=console) as state, httpx.Client(timeout=300) as client:
        for index in range(count):
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            per_turn, expected = [], []
            for user in script_user_turns(index, turns):
                messages.append({"role": "user", "content": user})
                per_turn.append([dict(m) for m in messages])
                out = greedy_chat(state.router, state.served_model_name, messages,
                                  SOAK_MAX_TOKENS, client=client)
                expected.append(out)
                messages.append({"role": "assistant", "content": out.text})
            scripts.append(Script(per_turn, expected))
    return scripts


class RouterProcess:
    """A router on the cluster's engines and Redis: started here, or the launcher's."""

    def __init__(self, name: str, url: str, pid: int, popen: subprocess.Popen[bytes] | None
                 ) -> None:
        self.name, self.url, self.pid, self.popen = name, url, pid, popen

    @classmethod
    def start(cls, name: str, launched: Cluster, port: int = 0) -> RouterProcess:
        logs = launched.run_dir / "logs"
        port_file = logs / f"{name}.addr"
        port_file.unlink(missing_ok=True)
        log = logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                launched.router_command(port, port_file), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        router = cls(name, "", popen.pid, popen)
        deadline = time.monotonic() + 60
        while True:
            bound = read_report(port_file)
            if bound is not None:
                router.url = f"http://{bound[0]}:{bound[1]}"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{router.url}/health", timeout=2).status_code == 200:
                        return router
            if popen.poll() is not None or time.monotonic() > deadline:
                router.stop()
                raise RuntimeError(f"{name} did not start; see {log}")
            time.sleep(0.2)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill_9(self) -> None:
        """SIGKILL the router's process group, as a crash or the OOM killer would, and wait
        until it is gone (its port is then free for the restart)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class Attempt:
    router: str
    at_s: float
    kind: str  # ok, wrong, garbled, status, error_event, connection, timeout
    status: int | None = None
    detail: str = ""
    retry_after_s: float | None = None


@dataclass
class TurnResult:
    session: str
    turn: int
    outcome: str  # ok, lost_wrong, lost_garbled, lost_refused, lost_unanswered
    attempts: list[Attempt]
    seconds: float
    prefill_node: str | None = None


@dataclass
class SoakTally:
    results: Counter[str] = field(default_factory=Counter)
    ok_first_try: int = 0
    ok_after_retry: int = 0
    attempt_kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # ok turns, first attempt to answer
    retried: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    server_errors: list[dict[str, Any]] = field(default_factory=list)  # >= 500 but 503
    short_deltas: int = 0
    in_flight: int = 0
    open_sessions: set[str] = field(default_factory=set)

    def record(self, result: TurnResult) -> None:
        self.results[result.outcome] += 1
        for attempt in result.attempts:
            self.attempt_kinds[attempt.kind] += 1
            if attempt.status is not None:
                self.statuses[attempt.status] += 1
                if attempt.status >= 500 and attempt.status != 503:
                    self.server_errors.append({"session": result.session,
                                               "turn": result.turn, **asdict(attempt)})
        record = {"session": result.session, "turn": result.turn, "outcome": result.outcome,
                  "seconds": round(result.seconds, 2),
                  "attempts": [asdict(a) for a in result.attempts]}
        if result.outcome == "ok":
            self.latencies.append(result.seconds)
            if len(result.attempts) == 1:
                self.ok_first_try += 1
            else:
                self.ok_after_retry += 1
            if result.prefill_node is None:
                self.short_deltas += 1
        else:
            self.lost.append(record)
        # Every retried turn is kept up to a bound well above one per session per fault
        # (64 sessions x 3 faults): a record cut at 100 once read as turns that hung.
        if len(result.attempts) > 1 and len(self.retried) < 2000:
            self.retried.append(record)

    @property
    def attempted(self) -> int:
        return sum(self.results.values())


def retry_wait(attempt: Attempt, number: int) -> float:
    if attempt.retry_after_s is not None:
        return min(attempt.retry_after_s, RETRY_MAX_AFTER_S)
    return min(RETRY_MAX_WAIT_S, RETRY_INITIAL_S * 2 ** (number - 1))


async def attempt_turn(client: httpx.AsyncClient, router: RouterProcess, body: dict[str, Any],
                       expected: Completion, t0: float) -> tuple[Attempt, str | None]:
    """One attempt at a turn; (what happened, the prefill engine that served it)."""
    at = round(time.monotonic() - t0, 2)
    url = f"{router.url}/v1/chat/completions"
    token_ids: list[int] = []
    stats: dict[str, Any] | None = None
    try:
        if body["stream"]:
            done, error = False, None
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return status_attempt(router, at, response), None
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        done = True
                        continue
                    try:
                        event = json.loads(payload)
                    except json.JSONDecodeError:
                        return Attempt(router.name, at, "garbled",
                                       detail=f"not JSON: {payload[:200]}"), None
                    if "error" in event:
                        error = event["error"]
                    if isinstance(event.get("turnkv"), dict):
                        stats = event["turnkv"]
                    for choice in event.get("choices") or []:
                        token_ids.extend(choice.get("token_ids") or [])
            if error is not None:
                message = error.get("message") if isinstance(error, dict) else error
                return Attempt(router.name, at, "error_event", 200, str(message)[:300]), None
            if not done or stats is None:
                return Attempt(router.name, at, "garbled", 200,
                               "the stream ended without its stats or [DONE]"), None
        else:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                return status_attempt(router, at, response), None
            try:
                data = response.json()
                token_ids = list(data["choices"][0]["token_ids"])
                stats = data.get("turnkv")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                return Attempt(router.name, at, "garbled", 200,
                               f"{exc!r}: {response.text[:200]}"), None
            if stats is None:
                return Attempt(router.name, at, "garbled", 200, "no turnkv stats"), None
    except httpx.TimeoutException as exc:
        return Attempt(router.name, at, "timeout", detail=f"{type(exc).__name__}"), None
    except httpx.TransportError as exc:
        return Attempt(router.name, at, "connection",
                       detail=f"{type(exc).__name__}: {exc}"[:300]), None
    verdict = compare(expected, Completion(token_ids, ""))
    if not verdict.acceptable:
        return Attempt(router.name, at, "wrong", 200,
                       f"{verdict.describe()}; got {token_ids}, expected "
                       f"{expected.token_ids}"), None
    return Attempt(router.name, at, "ok", 200), (stats or {}).get("prefill_node")


def status_attempt(router: RouterProcess, at: float, response: httpx.Response) -> Attempt:
    after = response.headers.get("retry-after")
    try:
        retry_after = float(after) if after else None
    except ValueError:
        retry_after = None
    return Attempt(router.name, at, "status", response.status_code, response.text[:300],
                   retry_after)


async def play_turn(client: httpx.AsyncClient, router: RouterProcess, body: dict[str, Any],
                    expected: Completion, t0: float, budget_s: float) -> TurnResult:
    """A turn until it is answered, as a client with the SDK's retry policy plays it: 429 and
    503 (after Retry-After), connection errors and timeouts are retried, and so is a stream
    that ends with an error event (an agent replays that turn; the SDK itself retries only
    before the first byte). A wrong or garbled answer, or any other status, is final."""
    tag = body["turnkv"]
    start = time.monotonic()
    attempts: list[Attempt] = []
    while True:
        attempt, prefill = await attempt_turn(client, router, body, expected, t0)
        attempts.append(attempt)
        elapsed = time.monotonic() - start
        if attempt.kind == "ok":
            return TurnResult(tag["session_id"], tag["turn"], "ok", attempts, elapsed, prefill)
        if attempt.kind in ("wrong", "garbled"):
            return TurnResult(tag["session_id"], tag["turn"], f"lost_{attempt.kind}",
                              attempts, elapsed)
        if attempt.kind == "status" and attempt.status not in RETRY_STATUSES:
            return TurnResult(tag["session_id"], tag["turn"], "lost_refused", attempts,
                              elapsed)
        wait = retry_wait(attempt, len(attempts))
        if elapsed + wait > budget_s:
            return TurnResult(tag["session_id"], tag["turn"], "lost_unanswered", attempts,
                              elapsed)
        await asyncio.sleep(wait)


@dataclass
class SoakPlan:
    minutes: float
    sessions: int
    turns: int
    scripts: int
    retry_budget_s: float
    seed: int


async def worker(index: int, plan: SoakPlan, client: httpx.AsyncClient,
                 routers: list[RouterProcess], scripts: list[Script], model: str,
                 tally: SoakTally, deadline: float, t0: float) -> None:
    """Sessions back to back until the deadline (the last one is played to its end): each
    turn through the other router than the one before, every other session streamed, the
    last turn `final`. Each session has its own cache salt: its KV is its own, as another
    user's conversation would be, although its tokens equal its script's."""
    rng = random.Random(plan.seed * 1000 + index)
    number = 0
    while time.monotonic() < deadline:
        session = f"soak-{index}-{number}"
        script = scripts[rng.randrange(len(scripts))]
        stream = (index + number) % 2 == 0
        tally.open_sessions.add(session)
        for turn in range(1, plan.turns + 1):
            body = {"model": model, "messages": script.messages[turn - 1],
                    "max_tokens": SOAK_MAX_TOKENS, "temperature": 0, "return_token_ids": True,
                    "stream": stream, "cache_salt": session,
                    "turnkv": {"session_id": session, "turn": turn,
                               "hints": {"final": turn == plan.turns, "next_turn_in": 1}}}
            if stream:
                body["stream_options"] = {"include_usage": True}
            router = routers[(index + turn) % len(routers)]
            tally.in_flight += 1
            try:
                result = await play_turn(client, router, body, script.expected[turn - 1], t0,
                                         plan.retry_budget_s)
            finally:
                tally.in_flight -= 1
            tally.record(result)
            if turn == plan.turns and result.outcome == "ok":
                tally.open_sessions.discard(session)
        number += 1


@dataclass
class Fault:
    what: str
    planned_at_s: float
    killed_at_s: float | None = None
    back_at_s: float | None = None
    error: str | None = None


class Soak:
    """The cluster under soak: its engines, routers and Redis, and the samples taken."""

    def __init__(self, launched: Cluster, state: ClusterState, routers: list[RouterProcess],
                 t0: float, console: Console) -> None:
        self.launched, self.state, self.routers = launched, state, routers
        self.t0, self.console = t0, console
        self.samples: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.lock = threading.Lock()  # the routers list, swapped by a restart
        self.redis_pid = next((p.pid for p in psutil.Process().children()
                               if p.name() == "redis-server"), None)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def engine(self, role: str) -> EngineProcess:
        return next(e for e in self.launched.engines if e.spec.role == role)

    def engine_urls(self) -> dict[str, str]:
        return {e.spec.name: e.spec.url for e in self.launched.engines}

    def sample(self, tally: SoakTally) -> dict[str, Any]:
        rss: dict[str, float | None] = {}
        for engine in self.launched.engines:
            rss[engine.spec.name] = (group_rss_mib(engine.ref.pid) if engine.ref is not None
                                     else None)
        with self.lock:
            routers = list(self.routers)
        for router in routers:
            rss[router.name] = group_rss_mib(router.pid)
        rss["redis"] = process_rss_mib(self.redis_pid) if self.redis_pid else None
        rss["soak client"] = process_rss_mib(os.getpid())
        point = {"t_s": self.now(), "rss_mib": {k: _round(v) for k, v in rss.items()},
                 "kv": kv_state(self.engine_urls()),
                 "turns_ok": tally.results["ok"], "turns_lost": tally.attempted
                 - tally.results["ok"], "turns_in_flight": tally.in_flight}
        self.samples.append(point)
        return point

    # -- faults ------------------------------------------------------------------------------

    def restart_engine(self, fault: Fault, role: str) -> None:
        engine = self.engine(role)
        assert engine.ref is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.ref.pid, signal.SIGKILL)
        fault.killed_at_s = self.now()
        engine.stop()  # reaps what is left, and holds its ports for the restart
        engine.start()
        deadline = time.monotonic() + 300
        while not engine.is_healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine.spec.name} not healthy 300 s after its restart")
            time.sleep(0.5)
        engine.pin()
        # Back when every router's health probe has seen it.
        self._wait_routers_see_healthy()
        fault.back_at_s = self.now()

    def restart_router(self, fault: Fault, name: str) -> None:
        with self.lock:
            index = next(i for i, r in enumerate(self.routers) if r.name == name)
            victim = self.routers[index]
        port = victim.port
        victim.kill_9()
        fault.killed_at_s = self.now()
        # Hold the port until the new process has bound it: clients know this address.
        with PortHold("127.0.0.1", [port]):
            heir = RouterProcess.start(name, self.launched, port)
        with self.lock:
            self.routers[index] = heir
        fault.back_at_s = self.now()

    def _wait_routers_see_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.lock:
                routers = list(self.routers)
            try:
                if all(all(e["healthy"] for e in httpx.get(
                        f"{r.url}/v1/turnkv/stats", timeout=5).json()["engines"])
                        for r in routers):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)

    def inject(self, fault: Fault) -> None:
        try:
            if fault.what == "decode engine":
                self.restart_engine(fault, "decode")
            elif fault.what == "prefill engine":
                self.restart_engine(fault, "prefill")
            else:
                self.restart_router(fault, fault.what)
        except Exception as exc:  # recorded and reported; the soak goes on
            fault.error = f"{type(exc).__name__}: {exc}"


async def soak_run(plan: SoakPlan, soak: Soak, scripts: list[Script], console: Console
                   ) -> SoakTally:
    tally = SoakTally()
    length = plan.minutes * 60
    deadline = time.monotonic() + length
    limits = httpx.Limits(max_connections=plan.sessions + 8,
                          max_keepalive_connections=plan.sessions + 8)
    timeout = httpx.Timeout(SOAK_CLIENT_TIMEOUT_S, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        # Each worker reads the live list: a restarted router replaces its entry.
        players = [asyncio.create_task(worker(
            w, plan, client, soak.routers, scripts, soak.state.served_model_name, tally,
            deadline, soak.t0)) for w in range(plan.sessions)]
        faults = [Fault(what, round(share * length, 1)) for what, share in FAULTS]
        soak.faults = faults

        async def injector() -> None:
            for fault in faults:
                await asyncio.sleep(max(0.0, fault.planned_at_s - (time.monotonic() - soak.t0)))
                console.print(f"[yellow]{soak.now():7.1f} s: SIGKILL {fault.what}[/]")
                await asyncio.to_thread(soak.inject, fault)
                console.print(f"[yellow]{soak.now():7.1f} s: {fault.what} back"
                              + (f" ({fault.error})" if fault.error else "") + "[/]")

        faulting = asyncio.create_task(injector())
        columns = (TextColumn("[bold]soak"), BarColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[line]}"))
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("soak", total=length, line="")
            while not all(p.done() for p in players):
                point = await asyncio.to_thread(soak.sample, tally)
                rss = " ".join(f"{k} {v:.0f}" for k, v in point["rss_mib"].items()
                               if v is not None)
                pinned = " ".join(f"{k} {v['pinned_blocks']:.0f}"
                                  for k, v in point["kv"].items()
                                  if v["pinned_blocks"] is not None)
                progress.update(task, completed=min(length, soak.now()), line=(
                    f"turns ok {tally.results['ok']} retried {len(tally.retried)} "
                    f"lost {tally.attempted - tally.results['ok']} "
                    f"in flight {tally.in_flight} | pinned {pinned} | MiB {rss}"))
                await asyncio.wait(players, timeout=SOAK_SAMPLE_S)
            await asyncio.gather(*players)
        await faulting
        soak.sample(tally)
    return tally


def soak(args: argparse.Namespace, console: Console) -> int:
    plan = SoakPlan(minutes=args.minutes, sessions=args.sessions, turns=args.turns,
                    scripts=args.scripts, retry_budget_s=args.retry_budget, seed=args.seed)
    run_dir = new_run_dir("soak")
    console.print(f"soak: {plan}; run folder {run_dir}")
    started, measured = time.time(), revision()
    console.print("reference outputs on one engine (`single` mode)")
    scripts = reference_scripts(plan.scripts, plan.turns, console, run_dir)
    extra: RouterProcess | None = None
    routers: list[RouterProcess] = []
    with redis_server(run_dir) as redis_url:
        config = ClusterConfig(
            mode="turnkv", model="tiny", dtype="float32", run_dir=run_dir / "cluster",
            kv_cache_bytes=(SOAK_BLOCKS + 1) * BLOCK_BYTES,
            router_args=("--redis", redis_url, "--health-interval", "1",
                         "--engine-read-timeout", str(SOAK_READ_TIMEOUT_S)),
            connector_settings={"lease_ttl_s": SOAK_LEASE_S,
                                "lease_max_ttl_s": SOAK_MAX_LEASE_S})
        launched = Cluster(config, console=console)
        try:
            with launched as state:
                assert state.router_process is not None
                first = RouterProcess("router-1", state.router, state.router_process.pid, None)
                extra = RouterProcess.start("router-2", launched)
                routers = [first, extra]
                caps = {e.spec.name: int(((counters(e.spec.url) or {}).get(
                    "num_gpu_blocks", SOAK_BLOCKS + 1) - 1) * 0.5) for e in launched.engines}
                t0 = time.monotonic()
                soak_ = Soak(launched, state, routers, t0, console)
                tally = asyncio.run(soak_run(plan, soak_, scripts, console))
                console.print(f"{tally.attempted} turns; releasing sessions, then waiting out "
                              "the leases")
                after = soak_aftermath(soak_, tally)
        finally:
            # The routers this script started (the launcher stops its own); by PID.
            for router in routers:
                if router.popen is not None:
                    router.stop()
    findings = scan_logs(run_dir)
    return soak_report(args, plan, (started, measured), run_dir, soak_, tally, caps, after,
                       findings, console)


def soak_aftermath(soak: Soak, tally: SoakTally) -> dict[str, Any]:
    """Release the sessions whose `final` turn did not end them, wait until no engine request
    is in flight, then wait the leases' TTL out without sending anything and read every
    engine's pinned and used blocks."""
    router = soak.routers[-1].url
    released = {}
    with httpx.Client(timeout=30) as client:
        for session in sorted(tally.open_sessions):
            with contextlib.suppress(httpx.HTTPError):
                released[session] = client.delete(
                    f"{router}/v1/turnkv/sessions/{session}").status_code
        deadline = time.monotonic() + 60
        in_flight: dict[str, dict[str, int]] = {}
        while time.monotonic() < deadline:
            in_flight = {}
            for r in soak.routers:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    in_flight[r.name] = {e["name"]: e["in_flight"] for e in client.get(
                        f"{r.url}/v1/turnkv/stats").json()["engines"]}
            if all(not any(v.values()) for v in in_flight.values()):
                break
            time.sleep(0.5)
        idle = wait_until_clear(soak.engine_urls(), timeout=SOAK_MAX_LEASE_S + 60)
        ticked: Clearing | None = None
        if idle.seconds is None:
            # One request makes a lazy expiry run: tells a leak from a late expiry.
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{router}/v1/chat/completions", json={
                    "model": soak.state.served_model_name, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "tick"}]})
            ticked = wait_until_clear(soak.engine_urls(), timeout=30)
    final_counters = {name: counters(url) for name, url in soak.engine_urls().items()}
    return {"sessions_released_at_end": len(released),
            "release_statuses": dict(Counter(released.values())),
            "in_flight": in_flight,
            **clearing_report(idle, ticked),
            "engine_counters": final_counters}


def soak_report(args: argparse.Namespace, plan: SoakPlan, when: tuple[float, str],
                run_dir: Path,
                soak: Soak, tally: SoakTally, caps: dict[str, int], after: dict[str, Any],
                findings: dict[str, Any], console: Console) -> int:
    pinned_max: dict[str, float] = {}
    for point in soak.samples:
        for name, kv in point["kv"].items():
            if kv["pinned_blocks"] is not None:
                pinned_max[name] = max(pinned_max.get(name, 0.0), kv["pinned_blocks"])
    memory: dict[str, dict[str, float | None]] = {}
    names = {n for p in soak.samples for n in p["rss_mib"]}
    for name in sorted(names):
        series = [p["rss_mib"].get(name) for p in soak.samples]
        values = [v for v in series if v is not None]
        if values:
            memory[name] = {"first": values[0], "last": values[-1], "max": max(values)}
    lost = tally.attempted - tally.results["ok"]
    lost_by_kind = {k: n for k, n in tally.results.items() if k != "ok"}
    result = {
        "command": (f"python scripts/reliability.py soak --minutes {plan.minutes:g} "
                    f"--sessions {plan.sessions} --turns {plan.turns} --scripts {plan.scripts} "
                    f"--retry-budget {plan.retry_budget_s:g} --seed {plan.seed}"),
        "revision": when[1],
        "when": datetime.fromtimestamp(when[0]).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "memory_gib": round(
            psutil.virtual_memory().total / 2**30, 1)},
        "plan": asdict(plan),
        "cluster": {"mode": "turnkv", "model": "tiny (float32)", "blocks_per_engine": SOAK_BLOCKS,
                    "pin_caps": caps, "lease_ttl_s": SOAK_LEASE_S,
                    "lease_max_ttl_s": SOAK_MAX_LEASE_S, "routers": 2, "redis": True,
                    "engine_read_timeout_s": SOAK_READ_TIMEOUT_S,
                    "max_tokens": SOAK_MAX_TOKENS},
        "run_dir": shown(run_dir),
        "seconds": soak.samples[-1]["t_s"] if soak.samples else None,
        "faults": [asdict(f) for f in soak.faults],
        "turns": {"attempted": tally.attempted, "ok": tally.results["ok"],
                  "ok_first_try": tally.ok_first_try, "ok_after_retry": tally.ok_after_retry,
                  "lost": lost, "lost_by_kind": lost_by_kind,
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
        "memory_mib": memory,
        "after": after,
        "samples": soak.samples,
        "logs": findings,
    }
    out = Path(args.out)
    write_json(out, result)
    plot_memory(soak, caps, Path(args.plot))
    console.print(f"wrote {out} and {args.plot}")
    console.print(f"turns {tally.attempted}: ok {tally.results['ok']} (after a retry "
                  f"{tally.ok_after_retry}), lost {lost} {lost_by_kind}; "
                  f"pinned at most {pinned_max} (caps {caps}); after: {after['kv_idle']}")
    missed = [goal for goal, failed in (
        ("lost turns", lost),
        ("answers at 500 or above other than 503", tally.server_errors),
        ("a fault not injected or not recovered", any(f.error for f in soak.faults)),
        ("pins over the cap", any(pinned_max.get(n, 0) > c for n, c in caps.items())),
        ("blocks left pinned or in use", not after["clear_idle"]),
    ) if failed]
    if missed:
        console.print(f"[red]missed: {', '.join(missed)}[/]")
    return 1 if missed else 0


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
    engines = set(caps)
    for name in sorted({n for p in soak.samples for n in p["rss_mib"]}):
        axis = big if name in engines else small
        axis.plot(minutes, [p["rss_mib"].get(name) for p in soak.samples], label=name)
    big.set_ylabel("engines: RSS (MiB)")
    small.set_ylabel("others: RSS (MiB)")
    big.set_title("Soak: resident memory of every process (an engine: all processes of its "
                  "group)")
    for engine in sorted(caps):
        pins.plot(minutes, [p["kv"].get(engine, {}).get("pinned_blocks") for p in soak.samples],
                  label=f"{engine} pinned")
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


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    f = commands.add_parser("fuzz", help="fuzz the router's HTTP API")
    f.add_argument("--cases", type=int, default=10_000)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", default=str(OUT_DIR / "fuzz.json"))
    s = commands.add_parser("soak", help="many sessions while engines and a router restart")
    s.add_argument("--minutes", type=float, default=10.0)
    s.add_argument("--sessions", type=int, default=64, help="sessions at once")
    s.add_argument("--turns", type=int, default=4, help="turns per session")
    s.add_argument("--scripts", type=int, default=8,
                   help="distinct conversations the sessions play")
    s.add_argument("--retry-budget", type=float, default=300.0,
                   help="seconds a turn may take, retries included, before it counts as lost")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=str(OUT_DIR / "soak.json"))
    s.add_argument("--plot", default=str(OUT_DIR / "memory.png"))
    args = parser.parse_args(argv)
    if args.command == "fuzz" and args.cases < len(KINDS):
        parser.error(f"--cases must be at least {len(KINDS)} (one per kind)")
    if args.command == "soak" and (args.sessions < 1 or args.turns < 1 or args.scripts < 1):
        parser.error("--sessions, --turns and --scripts must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    # SIGTERM (a CI runner, `kill`) must still stop the clusters: make it an exception that
    # the `with Cluster(...)` blocks see.
    signal.signal(signal.SIGTERM, _terminate)
    runs: dict[str, Callable[[argparse.Namespace, Console], int]] = {"fuzz": fuzz,
                                                                      "soak": soak}
    return runs[args.command](args, console)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
