"""Two clusters started at the same time on one machine (turnkv mode, tiny model, float32).

The launcher chooses no port: every engine binds its HTTP port and its side channel itself
(port 0) and reports the port it got, and so does the router, which starts once its engines
have reported theirs. Two clusters starting at once, each while the other takes ports, both
come up, and a turn through each router moves KV between its engines over the side channels
they reported, signed with the cluster's own secret.

The launcher used to choose ports that its engines bound minutes later, and another cluster's
router once took a side channel's port meanwhile; now it chooses none.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.oracle import routed_chat
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState
from turnkv_server.launcher.engine import SECRET_ENV
from turnkv_server.launcher.processes import group_members

BLOCKS = 32  # per engine: small caches, four engines share two cores and the memory
MAX_TOKENS = 8
STARTUP_S = 600.0  # four engines loading at once on two cores


def _listening_ports(pid: int) -> set[int]:
    """TCP ports on which the process group that `pid` leads listens."""
    pids = {p.pid for p in group_members(pid)}
    return {c.laddr.port for c in psutil.net_connections("tcp")
            if c.pid in pids and c.status == psutil.CONN_LISTEN and c.laddr}


def test_two_clusters_started_at_once(tiny_model: Path, tmp_path: Path) -> None:
    names = ("east", "west")
    together = threading.Barrier(len(names), timeout=STARTUP_S + 120)
    done = threading.Barrier(len(names), timeout=300)
    started: dict[str, tuple[Cluster, ClusterState]] = {}
    turns: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        # In fixed pools: the turn below moves KV from the prefill engine to the decode one.
        config = ClusterConfig(mode="turnkv", model=str(tiny_model), dtype="float32",
                               router_args=("--fixed-pools",),
                               run_dir=tmp_path / name, max_model_len=1024,
                               # The tiny model's KV takes 2,048 bytes a token in float32;
                               # vLLM keeps one block back.
                               kv_cache_bytes=(BLOCKS + 1) * 128 * 2048,
                               startup_timeout=STARTUP_S)
        launched = Cluster(config)
        try:
            with launched as state, httpx.Client(timeout=300) as client:
                started[name] = (launched, state)
                together.wait()  # both clusters up at once
                out = routed_chat(
                    state.router, state.served_model_name,
                    [{"role": "user", "content": f"Hello from the {name} cluster."}],
                    MAX_TOKENS, session={"session_id": name}, stream=False, client=client)
                decode = next(e for e in state.engines if e.role == "decode")
                turns[name] = {"stats": out.stats, "tokens": out.completion.token_ids,
                               "decode": fetch_connector_counters(decode.url),
                               "servers": _servers(state)}
                done.wait()  # neither stops while the other still works
        except BaseException as exc:
            errors.append(exc)
            together.abort()
            done.abort()

    threads = [threading.Thread(target=run, args=(name,), name=name) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]

    ports: dict[int, str] = {}
    for name, (launched, _) in started.items():
        # A turn through the router: computed on the prefill engine, its KV written into
        # the decode engine over the side channel the decode engine reported.
        turn = turns[name]
        assert turn["stats"]["prefill_node"] is not None and turn["tokens"]
        assert turn["decode"]["blocks_received"] > 0
        for server, facts in turn["servers"].items():
            # Each port is one that the server listening on it reported: no two the same.
            for port in facts["ports"]:
                assert port in facts["listening"], f"{name} {server}: {port} not its own"
                assert port not in ports, f"{name} {server} and {ports[port]}: {port}"
                ports[port] = f"{name} {server}"
            # The cluster's own secret: in the engines' environment, not on command lines.
            if server != "router":
                assert facts["secret"] == launched.side_channel_secret
            assert launched.side_channel_secret not in facts["cmdline"]
    secrets = {launched.side_channel_secret for launched, _ in started.values()}
    assert len(secrets) == len(names)


def _servers(state: ClusterState) -> dict[str, dict[str, Any]]:
    """What the processes of a running cluster listen on and were started with."""
    out = {}
    for server in [*state.engines, state.router_process]:
        assert server is not None
        ports = [int(server.url.rsplit(":", 1)[1])]
        if server.nixl_port is not None:
            ports.append(server.nixl_port)
        process = psutil.Process(server.pid)
        out[server.name] = {"ports": ports, "listening": _listening_ports(server.pid),
                            "secret": process.environ().get(SECRET_ENV),
                            "cmdline": " ".join(process.cmdline())}
    return out
