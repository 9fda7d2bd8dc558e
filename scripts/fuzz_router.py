"""The router's HTTP API fuzzed for many cases, measured (docs/reliability.md, Fuzz).

    python scripts/fuzz_router.py [--cases 10000] [--seed 0]     # -> docs/reliability/fuzz.json

Starts its own local `turnkv` cluster of the tiny model (float32): one prefill and one decode
engine, the router with two tenants' API keys, an admin key and small bounds on its Responses
store, as in tests/integration/test_router_security.py, and sends cases drawn with hypothesis
from the same strategies (tests/support/router_fuzz.py: chat, tagged turns, completions, raw
bodies and the session routes, the Responses API with its chains and stored responses, the
Messages API), split evenly over the kinds of case, seeded. Recorded: cases and requests per
kind, statuses, every answer at 500 or above with the request that caused it (without its
key), answers that broke the API's other promises (an error in another shape than its
route's), memory of each process every few hundred cases, whether the engines are healthy
after, what the Responses store holds per tenant against its bounds, and the KV blocks still
pinned or in use once the leases' TTL has passed. Nothing is asserted; the command exits 1 if
a goal was missed and says which. Every process it started is stopped when it ends, however it
ends.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Run as `python scripts/fuzz_router.py`, Python puts scripts/ on the path, not the repository:
# the fuzz strategies and the measurements are the tests' own (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.measure import Clearing, group_rss_mib, wait_until_clear  # noqa: E402
from tests.support.router_fuzz import (  # noqa: E402
    ADMIN_KEY,
    KEY_A,
    KEYS,
    KINDS,
    MARKER,
    Answer,
    Chain,
    Request,
    auth,
    fetch,
    problem,
)
from tests.support.run_record import (  # noqa: E402
    OUT_DIR,
    header,
    missed_goals,
    new_run_dir,
    percentiles,
    scan_logs,
    write_json,
)
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState  # noqa: E402
from turnkv_server.launcher.processes import raise_on_sigterm  # noqa: E402

# A turn's engine lease without a TTL hint; fuzzed hints ask for up to 600 s, which the
# engines cap at MAX_LEASE_S (the operator's cap), so that every lease is over soon after
# the last case and what is left pinned then is a leak.
LEASE_S = 3.0
MAX_LEASE_S = 10.0
# The Responses store's bounds per tenant: small, so that the fuzzed responses go past both.
RESPONSES_MAX_COUNT = 50
RESPONSES_MAX_BYTES = 256 * 1024
# Memory and health are sampled every this many cases.
SAMPLE_EVERY = 250
# A fuzzed answer that takes longer than this is recorded as a hang: a valid case (two tokens
# of the tiny model at most) is answered within a second here, and the connector's own
# timeouts (`send_timeout_s`, `receive_timeout_s`: minutes) would otherwise set the pace of
# the run.
TIMEOUT_S = 30.0
# Answers slower than this are listed (with their requests).
SLOW_S = 5.0
# Each list of findings in the JSON keeps this many (the counts are complete).
KEPT = 100
# The ID of an engine request in its answer: its transfer's ID, which the engines' logs name.
ANSWER_ID = re.compile(r'"id"\s*:\s*"([^"]+)"')


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
    slow: list[dict[str, Any]] = field(default_factory=list)  # answered, after SLOW_S
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
        if seconds > SLOW_S:
            self.slow.append({"kind": kind, "request": request.describe(),
                              "status": answer.status, "seconds": round(seconds, 1)})
        self.statuses.setdefault(kind, Counter())[answer.status] += 1
        wrong = problem(request, answer)
        if wrong is not None:
            entry = {"kind": kind, "request": request.describe(), "status": answer.status,
                     "answer": answer.text[:1000], "problem": wrong}
            (self.server_errors if answer.status >= 500 else self.other_problems).append(entry)

    def by_class(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for statuses in self.statuses.values():
            for status, n in statuses.items():
                total[f"{status // 100}xx"] += n
        return total


class FuzzRun:
    """The cases of one run against one cluster, with a live progress line. Every request
    and its answer's status go to `log` (JSON lines, in the run folder, with the answer's
    ID, which the engines' log lines name): what to look up when an engine logs a problem."""

    def __init__(self, state: ClusterState, client: httpx.Client, progress: Progress,
                 total: int, log: Path) -> None:
        self.state, self.client, self.progress = state, client, progress
        self.log = log.open("a")
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
            chain = Chain()  # a request may name the response an earlier one got
            for built in KINDS[kind].build(self.state.served_model_name, **drawn):
                request = chain.fill(built)
                sent = time.monotonic()
                answer: Answer | None = None
                error = None
                try:
                    answer = fetch(self.client, self.state.router, request)
                    chain.saw(answer)
                except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL) as exc:
                    error = f"{type(exc).__name__}: {exc}"
                self.tally.record(kind, request, answer, error, time.monotonic() - sent)
                found = ANSWER_ID.search(answer.text) if answer is not None else None
                self.log.write(json.dumps({
                    "at": datetime.now().isoformat(timespec="milliseconds"), "kind": kind,
                    "request": request.describe(),
                    "status": answer.status if answer is not None else error,
                    "id": found.group(1) if found else None}) + "\n")
            self.tally.cases[kind] += 1
            self.done += 1
            if self.done % SAMPLE_EVERY == 0:
                self.sample()
            self.show(kind)
        return one_case

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
        rss = {name: group_rss_mib(pid) for name, pid in self.pids.items()}
        self.tally.samples.append({
            "t_s": round(time.monotonic() - self.started, 1), "cases": self.done,
            "rss_mib": {name: None if v is None else round(v, 1) for name, v in rss.items()},
            "engines_healthy": healthy, "router_sessions": sessions})


def run_cases(run: FuzzRun, cases: int, first_seed: int) -> str | None:
    """`cases` cases split evenly over the kinds; why the run was cut short, if it was."""
    split = [cases // len(KINDS) + (i < cases % len(KINDS)) for i in range(len(KINDS))]
    for index, (kind, count) in enumerate(zip(KINDS, split, strict=True)):
        # Only the generate phase: nothing fails here, so there is nothing to shrink, and no
        # example database is read or written. Seeded: a rerun draws the same cases.
        test = settings(max_examples=count, deadline=None, database=None, derandomize=False,
                        phases=[Phase.generate], print_blob=False,
                        suppress_health_check=list(HealthCheck))(
            seed(first_seed + index)(given(**KINDS[kind].strategies)(run.case(kind))))
        try:
            test()
        except RouterDown as exc:
            return str(exc)
    return None


def responses_stored(client: httpx.Client, router: str) -> dict[str, dict[str, float]]:
    """What the router's Responses store holds, by tenant (its `/metrics`)."""
    text = client.get(f"{router}/metrics", headers=auth(ADMIN_KEY)).text
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("turnkv_responses_stored", "turnkv_responses_bytes"):
            for sample in family.samples:
                found.setdefault(sample.labels["tenant"], {})[family.name] = sample.value
    return found


def aftermath(client: httpx.Client, state: ClusterState) -> dict[str, Any]:
    """Is the cluster still well once the fuzzing is over, is the Responses store within its
    bounds, and is every block free again once the leases' TTL has passed (first without a
    request, then after one)?"""
    admin, engines = auth(ADMIN_KEY), {e.name: e.url for e in state.engines}
    deadline = time.monotonic() + 30
    while True:
        stats = client.get(f"{state.router}/v1/turnkv/stats", headers=admin).json()
        in_flight = {e["name"]: e["in_flight"] for e in stats["engines"]}
        if not any(in_flight.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    healthy = {e["name"]: e["healthy"] for e in stats["engines"]}
    stored = responses_stored(client, state.router)
    within = all(held.get("turnkv_responses_stored", 0) <= RESPONSES_MAX_COUNT
                 and held.get("turnkv_responses_bytes", 0) <= RESPONSES_MAX_BYTES
                 for held in stored.values())
    body = {"model": state.served_model_name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"{MARKER} still there?"}]}
    still = client.post(f"{state.router}/v1/chat/completions", json=body,
                        headers=auth(KEY_A)).status_code
    # That turn's own lease, and the fuzzed ones, end within the operator's cap: wait it out
    # without sending anything (an idle engine must expire its leases on its own).
    time.sleep(MAX_LEASE_S)
    idle = wait_until_clear(engines, timeout=120)
    ticked: Clearing | None = None
    if idle.seconds is None:
        # Only then: one request, which makes a lazy expiry run, to tell a leak from a late
        # expiry.
        client.post(f"{state.router}/v1/chat/completions", json=body, headers=auth(KEY_A))
        time.sleep(LEASE_S + 1)
        ticked = wait_until_clear(engines, timeout=30)
    return {"in_flight": in_flight, "engines_healthy": all(healthy.values()),
            "healthy": healthy, "a_valid_turn_after": still, "waited_s": MAX_LEASE_S,
            "responses_stored": stored, "responses_within_bounds": within,
            "clear_idle": idle.seconds is not None, "clear_idle_after_s": idle.seconds,
            "kv_idle": idle.last, "kv_idle_steps": idle.steps,
            "clear_after_a_request": None if ticked is None else ticked.seconds is not None,
            "kv_after_a_request": None if ticked is None else ticked.last}


def fuzz(args: argparse.Namespace, console: Console) -> int:
    run_dir = new_run_dir("fuzz")
    keys_file = run_dir / "api-keys.json"
    keys_file.write_text(json.dumps(KEYS))
    config = ClusterConfig(
        mode="turnkv", model="tiny", dtype="float32", run_dir=run_dir,
        router_args=("--api-keys", str(keys_file), "--admin-key", ADMIN_KEY,
                     "--responses-max-count", str(RESPONSES_MAX_COUNT),
                     "--responses-max-bytes", str(RESPONSES_MAX_BYTES)),
        connector_settings={"lease_ttl_s": LEASE_S, "lease_max_ttl_s": MAX_LEASE_S})
    console.print(f"fuzz: {args.cases} cases, seed {args.seed}; run folder {run_dir}")
    started = time.time()
    command = f"python scripts/fuzz_router.py --cases {args.cases} --seed {args.seed}"
    record = header(command, started, run_dir)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[line]}"))
    with Cluster(config, console=console) as state, \
            httpx.Client(timeout=TIMEOUT_S) as client, \
            Progress(*columns, console=console) as progress:
        run = FuzzRun(state, client, progress, args.cases, run_dir / "cases.jsonl")
        run.sample()
        try:
            aborted = run_cases(run, args.cases, args.seed)
        finally:
            run.log.close()
        fuzz_s = time.monotonic() - run.started
        if aborted is None:
            run.sample()
        progress.stop()
        console.print(f"{run.done} cases in {fuzz_s:.0f} s; checking the cluster")
        after = aftermath(client, state)
    tally, done = run.tally, run.done
    logs = scan_logs(run_dir, (*KEYS, ADMIN_KEY, MARKER))
    classes = tally.by_class()
    record |= {
        "cluster": {"mode": "turnkv", "model": "tiny (float32)",
                    "engines": [e.name for e in state.engines],
                    "lease_ttl_s": LEASE_S, "lease_max_ttl_s": MAX_LEASE_S,
                    "responses_max_count": RESPONSES_MAX_COUNT,
                    "responses_max_bytes": RESPONSES_MAX_BYTES},
        "aborted": aborted, "seconds": round(fuzz_s, 1),
        "cases_per_s": round(done / max(fuzz_s, 1e-9), 2),
        "cases": dict(tally.cases), "cases_total": done,
        "requests": dict(tally.requests), "requests_total": sum(tally.requests.values()),
        "statuses": {kind: {str(s): n for s, n in sorted(c.items())}
                     for kind, c in tally.statuses.items()},
        "status_classes": dict(sorted(classes.items())),
        "answers_500_or_above": len(tally.server_errors),
        "server_errors": tally.server_errors[:KEPT],
        "other_problems_count": len(tally.other_problems),
        "other_problems": tally.other_problems[:KEPT],
        "no_answer_count": len(tally.no_answer), "no_answer": tally.no_answer[:KEPT],
        "answer_seconds": percentiles(tally.seconds),
        "slow_count": len(tally.slow), "slow": tally.slow[:KEPT],
        "samples": tally.samples, "after": after, "logs": logs,
    }
    write_json(Path(args.out), record)
    console.print(f"wrote {args.out}")
    missed = missed_goals({
        "answers at 500 or above": tally.server_errors,
        "answers that broke another promise": tally.other_problems,
        "requests without an answer": tally.no_answer,
        "a run cut short": aborted,
        "engines unhealthy after": not after["engines_healthy"],
        "the Responses store over its bounds": not after["responses_within_bounds"],
        "blocks left pinned or in use": not after["clear_idle"],
        "a log holding a key or a prompt": any(v["holds_a_secret"] for v in logs.values()),
    })
    console.print(f"cases {done}; statuses {dict(sorted(classes.items()))}; "
                  f">=500: {len(tally.server_errors)}; other problems: "
                  f"{len(tally.other_problems)}; no answer: {len(tally.no_answer)}; "
                  f"blocks clear {after['clear_idle_after_s']} s after the wait")
    if missed:
        console.print(f"[red]missed: {', '.join(missed)}[/]")
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0,
                        help="the first kind's hypothesis seed (the next kinds': +1, +2, ...)")
    parser.add_argument("--out", default=str(OUT_DIR / "fuzz.json"))
    args = parser.parse_args(argv)
    if args.cases < len(KINDS):
        parser.error(f"--cases must be at least {len(KINDS)} (one per kind)")
    raise_on_sigterm()  # a killed run still stops its cluster
    return fuzz(args, Console(stderr=True))


if __name__ == "__main__":
    sys.exit(main())
