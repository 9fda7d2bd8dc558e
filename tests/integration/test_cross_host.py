"""A turnkv cluster across simulated hosts (tiny model, float32; `make test-hosts`).

Five hosts on one machine (`turnkv_server.launcher.hosts`: a network namespace each, on a
private bridge): the prefill engine, the decode engine, two routers and a Redis they share.
The launcher places the engines and its router there (`ClusterConfig.hosts`); the second
router and Redis are started here with `Host.argv`. The test process, in the machine's own
namespace, reaches every host over the bridge. KV moves between the engine hosts over UCX's
TCP transport on their veth links, so a shaped or cut link is what the KV meets.

Every turn is checked against a single engine's greedy output for the same conversation
(`tests.support.oracle`): across hosts, with the engines' link cut while a turn's KV moves,
and after the first router's host is gone (the second router finds the session in Redis).

Needs root (`ip netns`); skipped where simulated hosts are not permitted, or under CI (the `CI`
environment variable set) failed with the reason (`tests.support.prerequisites`). Marked `hosts`:
`make test` leaves it out, `make test-hosts` runs it (about two minutes here).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import SINGLE_TINY, TINY_BLOCK_BYTES, TINY_CACHE_BYTES, RouterProcess
from tests.support.conversation import SYSTEM, conversation
from tests.support.oracle import Completion, RoutedCompletion, compare, greedy_chat, routed_chat
from tests.support.prerequisites import cannot_run
from tests.support.redis_server import redis_server_on
from tests.support.reference import SHORT_SCRIPT, References
from tests.support.waiting import wait_for
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState
from turnkv_server.launcher.engine import EngineProcess
from turnkv_server.launcher.host_plan import Host
from turnkv_server.launcher.hosts import HostSet, find_runs, netns_permitted
from turnkv_server.launcher.placement import ROUTER
from turnkv_server.models import build_tiny

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

HOSTS = ("prefill", "decode", "router-a", "router-b", "redis")
TURNS = SHORT_SCRIPT.turns
MAX_TOKENS = SHORT_SCRIPT.max_tokens
# The tiny model's KV per token (float32), and its block: prefix hits are whole blocks.
BLOCK_TOKENS = 128
KV_BYTES_PER_TOKEN = TINY_BLOCK_BYTES // BLOCK_TOKENS
# A receive that gets no KV in this long is given up (cancelled, then recomputed), unless the
# sender's answers that its request still runs put the deadline further ahead. The cut outlasts
# the timeout: the receiver gives up while the link is down, or the KV arrives once it is back
# (both happen here, and both must leave the output exact).
RECEIVE_TIMEOUT_S = 3.0
# Longer than anything the receiver could wait out: TCP resends what a cut held back on a
# doubling backoff (about 0.2, 0.6, 1.4, 3.0, 6.2, 12.6, 25.4 s after the first loss), so writes
# the prefill engine posted before the cut land whenever the link is back, long after the
# receive gave up. (With the receiver handing its blocks back 15 s after it last asked for the
# KV, a 7 s cut once made the session's next turn differ from a single engine's: the late
# writes landed in blocks in use again. Now a given-up receive's blocks are quarantined until
# the sender says its writes settled.)
CUT_S = 20.0
# The decode host's link while the cut turn's KV moves: 16 Mbit/s spreads the prompt's KV
# (about 5 MB) over seconds, so that the cut lands mid-transfer; it is cut once this much has
# crossed it (the turn's HTTP requests to the decode engine are a few kB).
SHAPED_MBIT = 16.0
CUT_AFTER_BYTES = 256 * 1024
# The cut turn's conversation: a long first prompt (a tool's output, about 2,500 tokens), then
# two turns the decode engine serves alone from the history it holds.
LONG_TURNS = 3
LONG_SALT = "cross-host-long"
LISTING = "\n".join(f"{i:04d}  def handler_{i}(request): return store.get('key-{i * 7 % 97}')"
                    for i in range(100))


@dataclass
class Played:
    """A conversation on the single engine: each turn's messages and its answer."""

    messages: list[list[dict[str, Any]]]
    turns: list[Completion]


@dataclass
class CrossHost:
    hosts: HostSet
    launched: Cluster  # the engines and router A, placed by the launcher
    state: ClusterState  # state.router: router A
    router_b: RouterProcess

    def engine(self, role: str) -> EngineProcess:
        return next(e for e in self.launched.engines if e.spec.role == role)

    def turn(self, router: str, played: Played, session: str, n: int,
             client: httpx.Client, stream: bool = False) -> RoutedCompletion:
        """Turn `n` of `played` through `router`, equal to the single engine's answer."""
        out = routed_chat(router, self.state.served_model_name, played.messages[n - 1],
                          MAX_TOKENS, session={"session_id": session, "turn": n},
                          stream=stream, client=client, extra={"cache_salt": session})
        verdict = compare(played.turns[n - 1], out.completion)
        print(f"{session} turn {n} via {router}: {verdict.describe()}; "
              f"{out.stats['prompt_tokens']}")
        assert verdict.acceptable, f"{session} turn {n}: {verdict.describe()}"
        return out


def host_of(engine: EngineProcess) -> Host:
    assert engine.spec.placed_on is not None, engine.spec.name
    return engine.spec.placed_on


def long_conversation(replies: list[str]) -> list[list[dict[str, Any]]]:
    """The suite's conversation behind a long system prompt (a file the agent read)."""
    turns = conversation(replies, LONG_TURNS)
    for messages in turns:
        messages[0] = {"role": "system", "content": f"{SYSTEM}\n\nhandlers.py:\n{LISTING}"}
    return turns


@pytest.fixture(scope="module")
def permitted() -> None:
    """Skip (under CI: fail) before anything starts where simulated hosts cannot be made."""
    reason = netns_permitted()
    if reason is not None:
        cannot_run(f"simulated hosts need `ip netns add` (root), not permitted here: {reason}")


@pytest.fixture(scope="module")
def references(permitted: None, clusters: ClusterPool) -> dict[str, Played]:
    """The single tiny engine's answers (in this machine's own namespace), played before any
    host exists; the engine is stopped before the hosts' cluster starts (two cores). Only the
    conversations this module plays (the suite's `tiny_references` plays every tiny script,
    and `make test-hosts` runs this module alone)."""
    short = References(clusters, SINGLE_TINY)[SHORT_SCRIPT]
    _, single = clusters.get(SINGLE_TINY)
    replies: list[str] = []
    answers = []
    with httpx.Client(timeout=300) as client:
        for turn in range(LONG_TURNS):
            answers.append(greedy_chat(single.router, single.served_model_name,
                                       long_conversation(replies)[turn], MAX_TOKENS,
                                       client=client, extra={"cache_salt": LONG_SALT}))
            replies.append(answers[-1].text)
    clusters.release()
    return {"short": Played(short.messages, short.turns),
            "long": Played(long_conversation(replies), answers)}


@pytest.fixture(scope="module")
def cross_host(references: dict[str, Played], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[CrossHost]:
    run_dir = tmp_path_factory.mktemp("cross-host")
    tag: str | None = None
    try:
        # Stopped in reverse: router B, the cluster (router A, engines), Redis, the hosts.
        with ExitStack() as stack:
            hosts = stack.enter_context(HostSet(HOSTS))
            tag = hosts.tag
            # Runs after every process below was stopped by its PID, before the hosts go.
            stack.callback(no_process_left, hosts)
            (run_dir / "redis").mkdir()
            redis_url = stack.enter_context(redis_server_on(hosts["redis"], run_dir / "redis"))
            config = ClusterConfig(
                mode="turnkv", model=str(build_tiny()), dtype="float32",
                run_dir=run_dir / "cluster", kv_cache_bytes=TINY_CACHE_BYTES,
                connector_settings={"receive_timeout_s": RECEIVE_TIMEOUT_S},
                # In fixed pools: the P/D form's transfers between the hosts.
                router_args=("--redis", redis_url, "--fixed-pools"),
                hosts={"prefill-0": hosts["prefill"], "decode-0": hosts["decode"],
                       ROUTER: hosts["router-a"]})
            launched = Cluster(config)
            stack.callback(launched.stop)  # also after a failed start: it stops what it began
            state = launched.start()
            router_b = second_router(launched, hosts["router-b"], run_dir / "router-b")
            stack.callback(router_b.stop)
            yield CrossHost(hosts, launched, state, router_b)
    finally:
        # Every process stopped, every namespace, link, rule and route of the run removed.
        if tag is not None:
            assert tag not in find_runs(), find_runs()[tag]


def no_process_left(hosts: HostSet) -> None:
    """Nothing runs in any host any more: every process started there was stopped by the
    PID recorded for it (the PID of the server itself, `ip netns exec` having exec'd it)."""
    left = {host.name: hosts.pids(host.name) for host in hosts}
    assert not any(left.values()), left


def second_router(launched: Cluster, host: Host, run_dir: Path) -> RouterProcess:
    """Another router in front of `launched`'s engines, on `host`, sharing router A's Redis.
    `RouterProcess` runs a cluster's `router_command`: here that of a cluster whose
    configuration places its router on `host` and whose engines are `launched`'s (as the
    pool's router views do, tests/support/cluster_pool.py)."""
    assert launched.config.hosts is not None
    run_dir.mkdir()
    view = Cluster(dataclasses.replace(
        launched.config, run_dir=run_dir, hosts={**launched.config.hosts, ROUTER: host}))
    view.engines = launched.engines
    return RouterProcess(view, run_dir / "router.log")


# -- what the tests look at ------------------------------------------------------------------

def link_tx_bytes(host: Host) -> int:
    """Bytes sent into `host` over its link: its veth's bridge end transmits them."""
    return int(Path(f"/sys/class/net/{host.peer}/statistics/tx_bytes").read_text())


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def in_namespace(pid: int, host: Host) -> bool:
    """Whether process `pid` runs in `host`'s network namespace (`ip netns identify`'s
    test: the same namespace inode)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(
        f"/run/netns/{host.namespace}").st_ino


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def idle(router: str, client: httpx.Client) -> None:
    """Every engine healthy to `router` and none of its engine requests open (push backs run
    on after their turns)."""
    def settled() -> bool:
        engines = client.get(f"{router}/v1/turnkv/stats").json()["engines"]
        return all(e["healthy"] and e["in_flight"] == 0 for e in engines)
    wait_for(settled, f"{router}: engines healthy, nothing in flight", timeout=60,
             interval=0.25)


def assert_reused(out: RoutedCompletion, held_before: int) -> None:
    """A later turn in turnkv mode: a short delta on the decode engine alone, which holds the
    session's history and computes only what is new (from its last full block on)."""
    stats, tokens = out.stats, out.stats["prompt_tokens"]
    assert stats["prefill_node"] is None, stats
    assert tokens["decode_cached"] + tokens["decode_computed"] == tokens["total"], tokens
    new_tokens = tokens["total"] - (stats["prefix_break_at"] or held_before)
    assert tokens["decode_cached"] > 0 and tokens["decode_computed"] < new_tokens + BLOCK_TOKENS, (
        tokens, new_tokens)


def held(router: str, session: str, client: httpx.Client) -> int:
    record = client.get(f"{router}/v1/turnkv/sessions/{session}")
    record.raise_for_status()
    return int(record.json()["tokens_held"])


# -- the tests -------------------------------------------------------------------------------

def test_a_conversation_across_hosts_equals_a_single_engine(
        cross_host: CrossHost, references: dict[str, Played]) -> None:
    c, played = cross_host, references["short"]
    hosts = c.hosts
    # The range is blackholed while the hosts are up: nothing of it can leave the machine.
    blackholes = json.loads(subprocess.run(
        ["ip", "-j", "route", "show", "table", "main", "type", "blackhole"],
        capture_output=True, text=True, check=True).stdout)
    assert any(r["dst"] == str(hosts.subnet) and r.get("metric") == int(hosts.tag, 16)
               for r in blackholes), blackholes
    # Each engine runs in its host (the recorded PID is the server itself: `ip netns exec`
    # execs), listens on the host's address and has UCX on the host's interface.
    for engine, name in ((c.engine("prefill"), "prefill"), (c.engine("decode"), "decode")):
        host, ref = hosts[name], engine.ref
        assert ref is not None and engine.spec.placed_on == host
        assert in_namespace(ref.pid, host) and "serve_engine" in cmdline(ref.pid)
        env = environ(ref.pid)
        assert (env["UCX_NET_DEVICES"], env["UCX_TLS"]) == (host.interface, "tcp")
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == str(host.address)
        assert engine.spec.url.startswith(f"http://{host.address}:")
    assert c.state.router_process is not None
    assert in_namespace(c.state.router_process.pid, hosts["router-a"])
    assert c.state.router.startswith(f"http://{hosts['router-a'].address}:")
    assert in_namespace(c.router_b.process.pid, hosts["router-b"])

    prefill, decode = c.engine("prefill"), c.engine("decode")
    received = {e: fetch_connector_counters(e.spec.url)["bytes_received"]
                for e in (prefill, decode)}
    crossed = {e: link_tx_bytes(host_of(e)) for e in (prefill, decode)}
    with httpx.Client(timeout=300) as client:
        held_before = 0
        for n in range(1, TURNS + 1):
            out = c.turn(c.state.router, played, "across", n, client, stream=n % 2 == 0)
            assert (out.stats["decode_node"], out.stats["mode"]) == ("decode-0", "turnkv")
            if n > 1:
                assert_reused(out, held_before)
            held_before = held(c.state.router, "across", client)
        idle(c.state.router, client)
    # KV moved both ways (the prompt to the decode engine, each reply back to the prefill
    # engine), and every byte of it crossed the receiving host's link: UCX used the simulated
    # network, not shared memory.
    for engine in (prefill, decode):
        got = fetch_connector_counters(engine.spec.url)["bytes_received"] - received[engine]
        sent_in = link_tx_bytes(host_of(engine)) - crossed[engine]
        print(f"{engine.spec.name}: {got:.0f} KV bytes received, {sent_in} bytes into its host")
        assert 0 < got <= sent_in, (engine.spec.name, got, sent_in)


def test_the_engines_link_cut_mid_transfer(cross_host: CrossHost,
                                           references: dict[str, Played]) -> None:
    c, played = cross_host, references["long"]
    prefill, decode = c.engine("prefill"), c.engine("decode")
    decode_host = c.hosts["decode"]
    kv_bytes = played.turns[0].usage["prompt_tokens"] * KV_BYTES_PER_TOKEN
    assert kv_bytes > 8 * CUT_AFTER_BYTES, kv_bytes  # the cut lands well inside the transfer
    before = {e: fetch_connector_counters(e.spec.url) for e in (prefill, decode)}
    outcome: dict[str, Any] = {}

    def first_turn() -> None:
        with httpx.Client(timeout=300) as client:
            try:
                outcome["out"] = routed_chat(
                    c.state.router, c.state.served_model_name, played.messages[0], MAX_TOKENS,
                    session={"session_id": "cut", "turn": 1}, stream=False, client=client,
                    extra={"cache_salt": "cut"})
            except httpx.HTTPStatusError as exc:
                outcome["error"] = exc.response
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
                outcome["raised"] = exc

    thread = threading.Thread(target=first_turn, daemon=True)
    c.hosts.shape("decode", SHAPED_MBIT)
    try:
        start = link_tx_bytes(decode_host)
        thread.start()
        wait_for(lambda: link_tx_bytes(decode_host) - start >= CUT_AFTER_BYTES or
                 not thread.is_alive(), "the turn's KV moving to the decode host",
                 timeout=60, interval=0.005)
        moved, moving = link_tx_bytes(decode_host) - start, thread.is_alive()
        c.hosts.link_down("decode")
        time.sleep(CUT_S)
    finally:
        c.hosts.link_up("decode")
        c.hosts.unshape("decode")
    thread.join(timeout=120)
    assert not thread.is_alive(), "the cut turn never ended"
    print(f"cut after {moved} of about {kv_bytes} KV bytes; outcome: {sorted(outcome)}")
    assert moving and moved < kv_bytes / 2, "the turn's KV had (nearly) all moved before the cut"

    # The turn either completed with the single engine's output, or failed with a clear error.
    assert "raised" not in outcome, outcome.get("raised")
    with httpx.Client(timeout=300) as client:
        idle(c.state.router, client)
        after = {e: fetch_connector_counters(e.spec.url) for e in (prefill, decode)}
        print("decode:", {k: after[decode][k] - before[decode][k] for k in (
            "receives_done", "receives_failed", "receives_cancelled", "bytes_received")},
            "prefill:", {k: after[prefill][k] - before[prefill][k] for k in (
                "sends_done", "sends_failed", "bytes_sent")})
        if "out" in outcome:
            verdict = compare(played.turns[0], outcome["out"].completion)
            print(f"the cut turn completed: {verdict.describe()}")
            assert verdict.acceptable, verdict.describe()
        else:
            error = outcome["error"]
            print(f"the cut turn failed: {error.status_code} {error.text[:300]}")
            assert error.status_code >= 500 and error.json()["error"]["message"], error.text
            c.turn(c.state.router, played, "cut", 1, client)  # the agent replays it
        # Once the link is back, later turns are exact and reuse the history's KV, and their
        # replies move back to the prefill engine over the link again.
        pushed_before = fetch_connector_counters(prefill.spec.url)["receives_done"]
        held_before = held(c.state.router, "cut", client)
        for n in range(2, LONG_TURNS + 1):
            out = c.turn(c.state.router, played, "cut", n, client)
            assert_reused(out, held_before)
            held_before = held(c.state.router, "cut", client)
        idle(c.state.router, client)
        assert fetch_connector_counters(prefill.spec.url)["receives_done"] > pushed_before
    # A given-up receive's blocks were kept out of use while late writes could land, and come
    # back once the sender said its writes settled (and a grace): none stays held.
    quarantined = (after[decode].get("receives_quarantined", 0)
                   - before[decode].get("receives_quarantined", 0))
    print(f"receives quarantined on the decode engine: {quarantined:.0f}")
    wait_for(lambda: fetch_connector_counters(decode.spec.url).get("quarantined_blocks") == 0,
             "the quarantined blocks given back", timeout=60)
    assert fetch_connector_counters(decode.spec.url).get("quarantines_expired", 0) == 0


def test_a_router_host_gone_the_other_router_carries_the_session(
        cross_host: CrossHost, references: dict[str, Played]) -> None:
    c, played = cross_host, references["short"]
    router_a, router_b = c.state.router, c.router_b.url
    with httpx.Client(timeout=300) as client:
        for n in (1, 2):
            out = c.turn(router_a, played, "roaming", n, client)
        decode_node = out.stats["decode_node"]
        held_before = held(router_a, "roaming", client)
        idle(router_a, client)  # the push back of turn 2 has landed
        # Router A's host drops off the network, as a pulled cable or a dead machine would.
        c.hosts.link_down("router-a")
        try:
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{router_a}/health", timeout=1)
            # Router B knows the session from Redis alone, and serves it on as A would have:
            # the same decode engine, from the history it holds.
            record = client.get(f"{router_b}/v1/turnkv/sessions/roaming").json()
            assert record["turns"] == 2 and record["tokens_held"] == held_before
            for n in (3, 4):
                out = c.turn(router_b, played, "roaming", n, client, stream=n == 4)
                assert out.stats["decode_node"] == decode_node
                assert_reused(out, held_before)
                held_before = held(router_b, "roaming", client)
        finally:
            c.hosts.link_up("router-a")
