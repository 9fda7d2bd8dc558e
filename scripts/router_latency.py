"""Measure the latency the router adds to a turn.

Starts a local cluster (tiny model by default) in `--mode turnkv` (the default mode, whose
planner serves an idle home's turn whole) or `--mode standard` (vLLM's P/D), warms the prefix
caches, then interleaves two ways of serving the same request many times:

- direct: this script itself does what the router does, against the engines: in `turnkv` mode
  the one request to the session's home (the engine the router served the session on), in
  `standard` mode a prefill (max_tokens=1, remote decode) then a decode with the returned
  kv_transfer_params;
- routed: the same request through the router, tagged with one of 16 sessions.

The engines answer from their caches both ways, so the difference is the router's own cost:
one more HTTP hop, parsing, routing, the session table, stats. Reported: the difference of the
medians, the median of the paired differences (each routed request against the direct one
next to it, which cancels slow drifts of a shared machine), and the router process's CPU time
per turn.

    python scripts/router_latency.py [--mode turnkv|standard] [--model tiny] [--requests 300]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import httpx
import psutil
from rich.console import Console

from turnkv_server.engine.requests import PREFILL_FOR_REMOTE_DECODE
from turnkv_server.launcher import Cluster, ClusterConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("turnkv", "standard"), default="turnkv")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    console = Console()

    config = ClusterConfig(mode=args.mode, model=args.model, dtype="float32")
    with Cluster(config, console=console) as state, httpx.Client(timeout=60) as client:
        prefill = state.endpoints()["prefill"][0]  # type: ignore[index]
        decode = state.endpoints()["decode"][0]  # type: ignore[index]
        urls = {"prefill-0": prefill, "decode-0": decode}  # the router's names for them
        body = {"model": state.served_model_name, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello in one word."}]}
        homes: dict[int, str] = {}  # turnkv: each session's home, as the router placed it

        def direct(i: int) -> float:
            rid = str(uuid.uuid4())
            start = time.perf_counter()
            if args.mode == "turnkv":
                client.post(f"{homes[i % 16]}/v1/chat/completions",
                            headers={"X-Request-Id": rid}, json=body).raise_for_status()
                return time.perf_counter() - start
            first = client.post(f"{prefill}/v1/chat/completions", headers={"X-Request-Id": rid},
                                json={**body, "stream": False,
                                      "kv_transfer_params": PREFILL_FOR_REMOTE_DECODE})
            params = first.json()["kv_transfer_params"]
            second = client.post(f"{decode}/v1/chat/completions", headers={"X-Request-Id": rid},
                                 json={**body, "kv_transfer_params": params})
            second.raise_for_status()
            return time.perf_counter() - start

        def routed(i: int) -> float:
            start = time.perf_counter()
            response = client.post(f"{state.router}/v1/chat/completions",
                                   json={**body, "turnkv": {"session_id": f"lat-{i % 16}"}})
            response.raise_for_status()
            homes[i % 16] = urls[response.json()["turnkv"]["decode_node"]]
            return time.perf_counter() - start

        for i in range(32):  # warm caches, connections and the router's code paths
            routed(i)
            direct(i)
        assert state.router_process is not None
        router = psutil.Process(state.router_process.pid)
        direct_s, routed_s = [], []
        cpu_before = router.cpu_times()
        with console.status("measuring") as status:
            for i in range(args.requests):
                # Alternate the order so neither way always runs right after the other.
                if i % 2:
                    direct_s.append(direct(i))
                    routed_s.append(routed(i))
                else:
                    routed_s.append(routed(i))
                    direct_s.append(direct(i))
                status.update(f"measuring {i + 1}/{args.requests}")
        cpu_after = router.cpu_times()

    result = {
        "mode": args.mode,
        "requests": args.requests,
        "model": args.model,
        "direct_median_ms": 1000 * statistics.median(direct_s),
        "routed_median_ms": 1000 * statistics.median(routed_s),
    }
    result["added_median_ms"] = result["routed_median_ms"] - result["direct_median_ms"]
    result["added_paired_median_ms"] = 1000 * statistics.median(
        r - d for r, d in zip(routed_s, direct_s, strict=True))
    # Includes the router's own health probes of the engines, a small part.
    result["router_cpu_ms_per_turn"] = 1000 * (
        (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    ) / args.requests
    result = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
    console.print_json(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
