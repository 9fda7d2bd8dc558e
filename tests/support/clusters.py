"""What the integration tests run on: engine sets, the routers in front of them, and the
clusters the suite's tests share (`tests.support.cluster_pool.ClusterPool`, the `clusters`
fixture, keeps one engine set alive at a time and hands these out).

- an `EngineSet` is what the launcher starts from one `ClusterConfig`: the engines, and the
  launcher's own router in front of them;
- a `ClusterSpec` is what a group of tests talks to: an engine set through the launcher's
  router, or through a router of its own (`RouterView`) in front of some of the set's engines.
  Tests that differ only in router settings (a Redis store, timeouts, health probes, how many
  engines it routes to) share the engines that way: a router starts in a second, an engine
  set in half a minute to a minute. A router of a spec's own is also what the pool can start
  anew, holding no session, for a test that needs a clean cluster.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.redis_server import redis_server
from turnkv_server import local_http
from turnkv_server.launcher import Cluster, ClusterConfig
from turnkv_server.mode_names import ClusterMode
from turnkv_server.models import build_tiny, resolve_model
from turnkv_server.ports import read_report

# A registered receive that gets no KV in this long is recomputed (the engines' default:
# 120 s). test_faults.py's timed-out transfer waits it out; no other user of these engines
# has a transfer that takes seconds, so it changes nothing for them.
RECEIVE_TIMEOUT_S = 4.0
# The launcher's router of a shared engine set serves no test (each has a router of its own,
# which the pool can start anew): it should not probe them.
IDLE_ROUTER = ("--health-interval", "3600")
# A turnkv router in the P/D form (prefill engines compute, decode engines decode), for the
# tests of that form's machinery; without it the planner places each turn.
FIXED_POOLS = ("--fixed-pools",)


class RouterProcess:
    """Another router process on a cluster's engines (`launched.router_command`: the router
    `launched`'s configuration describes, in front of `launched.engines`), on `port` (0: a
    free one); stopped by its PID."""

    def __init__(self, launched: Cluster, log: Path, port: int = 0) -> None:
        port_file = log.with_suffix(".addr")
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [*launched.router_command(port, port_file)], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log = log
        self.url = ""
        deadline = time.monotonic() + 60
        while True:
            bound = read_report(port_file)
            if bound is not None:
                self.url = f"http://{bound[0]}:{bound[1]}"
            if bound and local_http.answers_health(self.url):
                return
            assert self.process.poll() is None, f"router exited; see {log}"
            assert time.monotonic() < deadline, f"router not healthy; see {log}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass(frozen=True)
class EngineSet:
    """Engines the launcher starts, with its own router: `config(run_dir)` says how."""

    name: str
    config: Callable[[Path], ClusterConfig]


@dataclass(frozen=True)
class RouterView:
    """A router of its own in front of the first `prefill` prefill and first `decode` decode
    engines of a set, with these settings (the set's mode and decoder KV TTL, unless `mode`
    says another: an `affinity` router in front of a set's decode engines serves every turn
    on one of them alone, no KV connector involved, without starting engines of its own)."""

    prefill: int = 1
    decode: int = 1
    mode: ClusterMode | None = None
    args: tuple[str, ...] = ()
    short_delta_tokens: int | None = None
    # Started before the router and stopped after it, in the router's run folder; yields
    # more router arguments (a Redis server: its URL).
    service: Callable[[Path], AbstractContextManager[tuple[str, ...]]] | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """What a group of tests talks to. `router` None: the launcher's own router (or, for a
    `single` set, the engine itself)."""

    name: str
    engines: EngineSet
    router: RouterView | None = None


@contextmanager
def redis_store(run_dir: Path) -> Iterator[tuple[str, ...]]:
    """A real redis-server for routers that share sessions: `--redis <its URL>`."""
    with redis_server(run_dir) as url:
        yield ("--redis", url)


# -- the engine sets -------------------------------------------------------------------------

# The tiny model's KV takes 2,048 bytes a token in float32, 128 tokens a block; vLLM keeps one
# block back (its null block).
TINY_BLOCK_BYTES = 128 * 2048
# KV caches of the tiny engines with a connector: 512 blocks (65,536 tokens, 128 MiB), far
# more than the suite's conversations hold. vLLM's CPU default (1 GiB) made each of them
# spend 5-10 s of its start registering the cache with NIXL, three engines at once.
TINY_CACHE_BLOCKS = 512
TINY_CACHE_BYTES = (TINY_CACHE_BLOCKS + 1) * TINY_BLOCK_BYTES


def _tiny(mode: Any, run_dir: Path, **settings: Any) -> ClusterConfig:
    return ClusterConfig(mode=mode, model=str(build_tiny()), dtype="float32", run_dir=run_dir,
                         **settings)


def _tiny_pair_set(mode: str) -> EngineSet:
    """One prefill and two decode engines (tiny model, float32) with TINY_CACHE_BLOCKS blocks
    each. Bidirectional engines read back however few tokens are missing
    (`kv_recompute_threshold=0`): exact stats to assert. turnkv engines give up a receive
    after RECEIVE_TIMEOUT_S."""
    connector = {"receive_timeout_s": RECEIVE_TIMEOUT_S} if mode == "turnkv" else {}
    return EngineSet(f"tiny-{mode}-1p2d", lambda run_dir: _tiny(
        mode, run_dir, num_prefill=1, num_decode=2, kv_recompute_threshold=0,
        kv_cache_bytes=TINY_CACHE_BYTES, connector_settings=connector,
        router_args=IDLE_ROUTER))


MODES = ("turnkv", "standard", "bidirectional", "push")
TINY_ENGINES = {mode: _tiny_pair_set(mode) for mode in MODES}

# One tiny engine alone, plain vLLM: the reference every routed turn is compared with, and
# the SDK's plain server.
SINGLE_TINY = ClusterSpec("single-tiny", EngineSet("single-tiny", lambda run_dir: _tiny(
    "single", run_dir)))
SINGLE_SMOLLM2 = ClusterSpec("single-smollm2", EngineSet("single-smollm2", lambda run_dir: (
    ClusterConfig(mode="single", model=str(resolve_model("smollm2")), dtype="float32",
                  run_dir=run_dir))))

# SmolLM2 behind the turnkv connector, float32: test_turnkv_connector.py's pair, which the demo
# agent's test in test_examples.py runs on too. Engine leases last SMOLLM2_LEASE_S unless a
# client asks for less (the router keeps sessions longer); turns adding at most
# SMOLLM2_SHORT_DELTA_TOKENS tokens are served by the decode engine alone. Turns go through a
# router of their own (`SMOLLM2_TURNKV`); the launcher's tests (`turnkv status`, `turnkv down`)
# talk to the launcher's (`SMOLLM2_LAUNCHER`).
SMOLLM2_LEASE_S = 10.0
SMOLLM2_SHORT_DELTA_TOKENS = 60
SMOLLM2_ENGINES = EngineSet("smollm2-turnkv", lambda run_dir: ClusterConfig(
    mode="turnkv", model=str(resolve_model("smollm2")), dtype="float32", run_dir=run_dir,
    connector_settings={"lease_ttl_s": SMOLLM2_LEASE_S},
    short_delta_tokens=SMOLLM2_SHORT_DELTA_TOKENS))
# The router in fixed pools: these tests are about the P/D form's transfers and push backs.
SMOLLM2_TURNKV = ClusterSpec("connector", SMOLLM2_ENGINES, RouterView(
    short_delta_tokens=SMOLLM2_SHORT_DELTA_TOKENS, args=FIXED_POOLS))
SMOLLM2_LAUNCHER = ClusterSpec("connector-launcher", SMOLLM2_ENGINES)

# test_lease_eviction.py's and test_tier.py's pair: one prefill and one decode engine (tiny
# model, float32) whose KV caches hold LEASE_EVICTION_BLOCKS blocks each (and vLLM's null
# block: the tiny model's KV takes 2,048 bytes a token, 128 tokens a block), 4,096 tokens, one
# prompt at the model's length, each with a host-memory tier of TIER_HOST_BLOCKS blocks below
# it (vLLM's offloading connector with this project's host spec, under vLLM's MultiConnector
# after the turnkv connector), and below that a disk tier of TIER_DISK_BLOCKS blocks (this
# project's checked files): what a long prompt pushes out of the host tier is found on disk.
# Room, and room only, ends leases there: they may pin the whole cache (no pin cap), and every
# turn goes through the prefill engine (no short deltas served by the decode engine alone):
# routers of the specs' own in front of both engines.
LEASE_EVICTION_BLOCKS = 32
TIER_HOST_BLOCKS = 16
TIER_DISK_BLOCKS = 256
# No shared tier below them (`ClusterConfig.tier_shared`): what these tests watch is each
# engine's own tiers, and the shared one would serve a chunk the disk tier refused.
TIER_ENGINES = EngineSet("tiny-turnkv-1p1d-32-blocks-tiers", lambda run_dir: _tiny(
    "turnkv", run_dir, kv_cache_bytes=(LEASE_EVICTION_BLOCKS + 1) * TINY_BLOCK_BYTES,
    connector_settings={"max_pinned_fraction": 1.0}, short_delta_tokens=0,
    tier_host_blocks=TIER_HOST_BLOCKS, tier_disk_bytes=TIER_DISK_BLOCKS * TINY_BLOCK_BYTES,
    tier_shared=False, router_args=IDLE_ROUTER))
LEASE_EVICTION = ClusterSpec("lease-eviction", TIER_ENGINES, RouterView(short_delta_tokens=0,
                                                                         args=FIXED_POOLS))
TIER = ClusterSpec("tier", TIER_ENGINES, RouterView(short_delta_tokens=0, args=FIXED_POOLS))
# The aggregated flavour on the same engines: an affinity router with `--engine-leases` in
# front of the decode engine alone, which serves whole turns with its connector and tier.
TIER_AFFINITY = ClusterSpec("tier-affinity", TIER.engines, RouterView(
    prefill=0, decode=1, mode="affinity", args=("--engine-leases",)))
# The pair as one pool on the same engines: a turnkv router with `--pair-pool` in front of both,
# each session served whole by one of them.
TIER_POOL = ClusterSpec("tier-pool", TIER.engines, RouterView(args=("--pair-pool",)))
# The default router (the planner) on the same engines: each turn of an idle home whole there.
TIER_PLANNER = ClusterSpec("tier-planner", TIER.engines, RouterView())
# Admission on the same engines: a turnkv router whose budget of session history
# (ADMISSION_TOKENS) holds one session of test_tier.py's conversation, not two; every turn
# through the prefill engine, as with `TIER`'s router.
ADMISSION_TOKENS = 300
TIER_ADMISSION = ClusterSpec("tier-admission", TIER.engines, RouterView(
    short_delta_tokens=0, args=(*FIXED_POOLS, "--admission-tokens", str(ADMISSION_TOKENS))))

# test_router_security.py's and test_load.py's pair: one prefill and one decode engine (tiny
# model, float32) whose KV caches hold LOAD_BLOCKS blocks each, so that the load test's 64 live
# sessions press against the connector's pin cap of half of them; engine leases last
# SHORT_LEASE_S unless a client asks otherwise, never past SHORT_LEASE_MAX_S, so that what a
# fuzzed or loaded session left behind comes back soon. Each module puts a router of its own
# in front (API keys for the one, none for the other). Each engine has a host tier of
# SHARED_TIER_HOST_BLOCKS blocks and, below both, the launcher's file tier that either engine
# reads (a turnkv cluster's default with a host tier): the fuzz and the load run over it too,
# and test_planner_placements.py's router moves sessions over it (`--shared-tier`).
LOAD_BLOCKS = 128
SHARED_TIER_HOST_BLOCKS = 64
SHORT_LEASE_S = 3.0
# The operator's cap on a lease, which a client's TTL hint cannot pass: the fuzz draws hints
# of up to 600 s, whose leases must still end within a test's wait.
SHORT_LEASE_MAX_S = 8.0
SHORT_LEASES = EngineSet("tiny-turnkv-1p1d-128-blocks-short-leases", lambda run_dir: _tiny(
    "turnkv", run_dir, kv_cache_bytes=(LOAD_BLOCKS + 1) * TINY_BLOCK_BYTES,
    connector_settings={"lease_ttl_s": SHORT_LEASE_S, "lease_max_ttl_s": SHORT_LEASE_MAX_S},
    tier_host_blocks=SHARED_TIER_HOST_BLOCKS, router_args=IDLE_ROUTER))

# The SDK, adapter and example tests: one prefill and one decode engine behind the router in
# `bidirectional` mode, where a session's turns reuse its KV. `state.router` is the router's
# URL; clients use `state.router + "/v1"`.
ROUTER_CLUSTER = ClusterSpec("router-cluster", TINY_ENGINES["bidirectional"],
                             RouterView(prefill=1, decode=1))
