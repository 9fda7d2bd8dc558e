"""A soak of many concurrent sessions while engines and a router are killed and restarted,
measured (docs/reliability.md, Soak).

    python scripts/soak.py [--minutes 10] [--sessions 64]
        # -> docs/reliability/soak.json, docs/reliability/memory.png

First the reference: a single engine plays the scripted conversations (greedy). Then a local
`turnkv` cluster of the tiny model (float32) whose KV caches are small enough that the
sessions' leases press the pin cap, with two routers sharing Redis; S sessions at once of T
turns each, each turn through the other router than the one before, every output checked
against the reference (tests/support/oracle.py). During the run the decode engine, the
prefill engine and the launcher's router are each killed with SIGKILL once and started again.
A turn that fails is retried under the SDK's retry policy, within a time budget. Memory of
every process and each engine's blocks are sampled every few seconds; at the end the leftover
sessions are released, the leases' TTL is waited out and every engine's pinned and used
blocks are read. Nothing is asserted; the command exits 1 if a goal was missed (a lost turn,
an answer at 500 or above other than 503, a block left pinned...) and says which. Every
process it started is stopped when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

# Run as `python scripts/soak.py`, Python puts scripts/ on the path (the soak's own modules),
# not the repository (the tests' support, which it shares).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soak_cluster import Fault, Router, Soak, counters  # noqa: E402
from soak_report import report  # noqa: E402
from soak_turns import MAX_TOKENS, Script, SoakTally, play_turn, reference_scripts  # noqa: E402

from tests.support.clusters import TINY_BLOCK_BYTES  # noqa: E402
from tests.support.redis_server import redis_server  # noqa: E402
from tests.support.run_record import OUT_DIR, new_run_dir, scan_logs  # noqa: E402
from turnkv_server.connector.settings import ConnectorSettings  # noqa: E402
from turnkv_server.launcher import Cluster, ClusterConfig  # noqa: E402
from turnkv_server.launcher.processes import raise_on_sigterm  # noqa: E402

# Blocks in each engine's KV cache: the connector's pin cap is half of them (64), which 64
# live sessions of a few blocks each press against (as in tests/integration/test_load.py).
BLOCKS = 128
PIN_FRACTION = ConnectorSettings.max_pinned_fraction  # the run leaves the default
# Engine leases: a session's blocks stay pinned this long after its last turn, unless `final`
# (or DELETE) releases them; short, so that the end of the run can wait them out.
LEASE_S = 30.0
MAX_LEASE_S = 60.0
# A hung engine fails its turn after this long without a byte (far sooner than the router's
# default `engine_read_timeout`).
READ_TIMEOUT_S = 60.0
# The client's own timeout per attempt; longer than the router's read timeout.
CLIENT_TIMEOUT_S = 180.0
SAMPLE_S = 5.0
# When in the run each fault comes, as a share of its length.
FAULTS = (("decode engine", 0.2), ("prefill engine", 0.45), ("router-1", 0.7))


@dataclass
class SoakPlan:
    minutes: float
    sessions: int
    turns: int
    scripts: int
    retry_budget_s: float
    seed: int
    faults: bool

    def command(self) -> str:
        return (f"python scripts/soak.py --minutes {self.minutes:g} --sessions {self.sessions} "
                f"--turns {self.turns} --scripts {self.scripts} --retry-budget "
                f"{self.retry_budget_s:g} --seed {self.seed}"
                + ("" if self.faults else " --no-faults"))


async def worker(index: int, plan: SoakPlan, client: httpx.AsyncClient, soak: Soak,
                 scripts: list[Script], tally: SoakTally, deadline: float) -> None:
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
            body: dict[str, Any] = {
                "model": soak.state.served_model_name, "messages": script.messages[turn - 1],
                "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
                "stream": stream, "cache_salt": session,
                "turnkv": {"session_id": session, "turn": turn,
                           "hints": {"final": turn == plan.turns, "next_turn_in": 1}}}
            if stream:
                body["stream_options"] = {"include_usage": True}
            with soak.lock:
                router = soak.routers[(index + turn) % len(soak.routers)]
            tally.in_flight += 1
            try:
                result = await play_turn(client, (router.name, router.url), body,
                                         script.expected[turn - 1], soak.t0, plan.retry_budget_s)
            finally:
                tally.in_flight -= 1
            tally.record(result)
            if turn == plan.turns and result.outcome == "ok":
                tally.open_sessions.discard(session)
        number += 1


def counts(tally: SoakTally) -> dict[str, int]:
    return {"turns_ok": tally.results["ok"], "turns_lost": tally.lost_count,
            "turns_in_flight": tally.in_flight}


async def soak_run(plan: SoakPlan, soak: Soak, scripts: list[Script], console: Console
                   ) -> SoakTally:
    tally = SoakTally()
    length = plan.minutes * 60
    deadline = time.monotonic() + length
    limits = httpx.Limits(max_connections=plan.sessions + 8,
                          max_keepalive_connections=plan.sessions + 8)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=10)
    soak.faults = [Fault(what, round(share * length, 1)) for what, share in FAULTS
                   ] if plan.faults else []

    async def injector() -> None:
        for fault in soak.faults:
            await asyncio.sleep(max(0.0, fault.planned_at_s - soak.now()))
            if all(p.done() for p in players):
                # Restarts before it took the rest of the run: a fault nobody would see.
                fault.error = "not injected: every client had ended"
                continue
            console.print(f"[yellow]{soak.now():7.1f} s: SIGKILL {fault.what}[/]")
            await asyncio.to_thread(soak.inject, fault)
            console.print(f"[yellow]{soak.now():7.1f} s: {fault.what} back"
                          + (f" ({fault.error})" if fault.error else "") + "[/]")

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        players = [asyncio.create_task(worker(w, plan, client, soak, scripts, tally, deadline))
                   for w in range(plan.sessions)]
        faulting = asyncio.create_task(injector())
        columns = (TextColumn("[bold]soak"), BarColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[line]}"))
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("soak", total=length, line="")
            while not all(p.done() for p in [*players, faulting]):
                point = await asyncio.to_thread(soak.sample, counts(tally))
                rss = " ".join(f"{k} {v:.0f}" for k, v in point["rss_mib"].items()
                               if v is not None)
                pinned = " ".join(f"{k} {v.pinned_blocks:.0f}" for k, v in point["kv"].items()
                                  if v.pinned_blocks is not None)
                progress.update(task, completed=min(length, soak.now()), line=(
                    f"turns ok {tally.results['ok']} retried {len(tally.retried)} "
                    f"lost {tally.lost_count} in flight {tally.in_flight} | pinned {pinned} "
                    f"| MiB {rss}"))
                await asyncio.wait([*players, faulting], timeout=SAMPLE_S)
            await asyncio.gather(*players, faulting)
    soak.sample(counts(tally))
    return tally


def soak(plan: SoakPlan, out: Path, plot: Path, console: Console) -> int:
    run_dir = new_run_dir("soak")
    started = time.time()
    console.print(f"soak: {plan}; run folder {run_dir}")
    console.print("reference outputs on one engine (`single` mode)")
    scripts = reference_scripts(plan.scripts, plan.turns, run_dir / "reference")
    routers: list[Router] = []
    with redis_server(run_dir) as redis_url:
        config = ClusterConfig(
            mode="turnkv", model="tiny", dtype="float32", run_dir=run_dir / "cluster",
            kv_cache_bytes=(BLOCKS + 1) * TINY_BLOCK_BYTES,
            router_args=("--redis", redis_url, "--health-interval", "1",
                         "--engine-read-timeout", str(READ_TIMEOUT_S)),
            connector_settings={"lease_ttl_s": LEASE_S, "lease_max_ttl_s": MAX_LEASE_S})
        launched = Cluster(config, console=console)
        try:
            with launched as state:
                assert state.router_process is not None
                routers.append(Router("router-1", state.router, state.router_process.pid))
                routers.append(Router.start("router-2", launched))
                caps = {e.spec.name: int(((counters(e.spec.url) or {}).get(
                    "num_gpu_blocks", BLOCKS + 1) - 1) * PIN_FRACTION)
                    for e in launched.engines}
                under_soak = Soak(launched, state, routers)
                tally = asyncio.run(soak_run(plan, under_soak, scripts, console))
                console.print(f"{tally.attempted} turns; releasing sessions, then waiting out "
                              "the leases")
                after = under_soak.aftermath(tally.open_sessions, MAX_LEASE_S + 60)
        finally:
            # The routers started here (the launcher stops its own); by PID.
            for router in routers:
                router.stop()
    cluster = {"mode": "turnkv", "model": "tiny (float32)", "blocks_per_engine": BLOCKS,
               "pin_caps": caps, "lease_ttl_s": LEASE_S, "lease_max_ttl_s": MAX_LEASE_S,
               "routers": 2, "redis": True, "engine_read_timeout_s": READ_TIMEOUT_S,
               "max_tokens": MAX_TOKENS}
    missed = report(plan.command(), started, run_dir, plan, cluster, under_soak, tally, after,
                    scan_logs(run_dir), out, plot, console)
    if missed:
        console.print(f"[red]missed: {', '.join(missed)}[/]")
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sessions", type=int, default=64, help="sessions at once")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--scripts", type=int, default=8,
                        help="distinct conversations the sessions play")
    parser.add_argument("--retry-budget", type=float, default=300.0,
                        help="seconds a turn may take, retries included, before it is lost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-faults", dest="faults", action="store_false",
                        help="kill nothing: memory and blocks of an undisturbed run")
    parser.add_argument("--out", default=str(OUT_DIR / "soak.json"))
    parser.add_argument("--plot", default=str(OUT_DIR / "memory.png"))
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.turns < 1 or args.scripts < 1:
        parser.error("--sessions, --turns and --scripts must be at least 1")
    plan = SoakPlan(args.minutes, args.sessions, args.turns, args.scripts, args.retry_budget,
                    args.seed, args.faults)
    raise_on_sigterm()  # a killed run still stops its clusters
    return soak(plan, Path(args.out), Path(args.plot), Console(stderr=True))


if __name__ == "__main__":
    sys.exit(main())
