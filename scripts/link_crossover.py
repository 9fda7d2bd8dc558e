"""Push or recompute, across hosts: what a turn's new tokens cost on the link at shaped rates.

A turnkv turn that adds D tokens either goes through the prefill engine, which computes them
and pushes their KV to the decode engine over the network, or is served by the decode engine
alone, which computes them itself (`--short-delta-tokens`: turns adding at most that many
tokens). Pushing frees the decode engine, which keeps generating for its other sessions, but
puts the KV on the link. It beats recomputing when the link carries D tokens' KV faster than an
engine computes them: the delta size above which that holds, at each link rate, is the figure a
deployment sets `--short-delta-tokens` from (below it, serve alone).

One turnkv pair (SmolLM2-135M-Instruct, float32, unless --model), each engine on a simulated
host of its own (`turnkv_server.launcher.hosts`: network namespaces on a private bridge, NIXL
over UCX's TCP transport on the host's interface), and two routers in front of the same
engines: one that pushes every turn (short deltas 0) and one that serves every turn on the
decode engine alone. For each repeat, each link rate (both engine hosts' links shaped with tc
tbf, or unshaped) and each delta size, two new sessions play two turns (a history of about
--history-tokens tokens, then D new tokens), one through each router; their second turns are
measured:

- push: the prefill engine's compute time (vLLM's per-request prefill time), the KV bytes it
  wrote to the decode engine, and the turn's time to first token (one token is generated, so
  the router's `total_ms`);
- alone: the decode engine's compute time for the same D tokens, and the time to first token.

Pushing pays when what it adds to the turn's first token (push TTFT minus alone TTFT: the hop,
and the part of the transfer that the prefill's compute does not hide, since the connector
writes layer by layer as the prompt computes) is less than the time the decode engine would
spend computing the delta itself, during which its other sessions' streams wait.

Writes --out/link.json (every turn, and per rate and size the medians with their ranges) and
--out/link.png, and prints a table. Needs root (network namespaces).

    python scripts/link_crossover.py --out docs/bench/cross-host
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from turnkv_server import local_http
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterConfig
from turnkv_server.launcher.hosts import HostSet
from turnkv_server.ports import read_report

TEXT = ("the log is flushed before the commit returns and a crash after that point loses "
        "nothing that was acknowledged to the client")


def text_of(tokens: int, seed: int) -> str:
    """About `tokens` tokens of plain text (SmolLM2's tokenizer: about one token a word)."""
    words = TEXT.split()
    return " ".join(words[(seed + i) % len(words)] for i in range(tokens))


def start_router(launched: Cluster, short_delta: int, log: Path) -> tuple[subprocess.Popen[bytes],
                                                                           str]:
    """A second router in front of the launched engines, serving alone every turn adding at
    most `short_delta` tokens."""
    config = dataclasses.replace(launched.config, short_delta_tokens=short_delta,
                                 register_as_current=False, hosts=None)
    other = Cluster(config)
    other.engines = launched.engines
    port_file = log.with_suffix(".addr")
    with open(log, "ab") as out:
        process = subprocess.Popen(other.router_command(0, port_file), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        bound = read_report(port_file)
        if bound is not None:
            url = f"http://{bound[0]}:{bound[1]}"
            if local_http.answers_health(url):
                return process, url
        time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"the second router did not come up; see {log}")


def second_turn(client: httpx.Client, router: str, model: str, history: int, delta: int,
                seed: int, prefill: str) -> tuple[dict[str, Any], float]:
    """Two turns of a new session, each answered with one token: the second's stats, and the
    KV bytes the prefill engine wrote for it."""
    session = f"link-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": text_of(history, seed)}]
    stats: dict[str, Any] = {}
    sent = 0.0
    for turn in (1, 2):
        before = fetch_connector_counters(prefill).get("bytes_sent", 0.0)
        reply = client.post(f"{router}/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": 1, "temperature": 0,
            # No session shares a prefix with another: each computes its own history.
            "cache_salt": session,
            "turnkv": {"session_id": session, "turn": turn, **(
                {"hints": {"final": True}} if turn == 2 else {})}})
        reply.raise_for_status()
        body = reply.json()
        stats = body["turnkv"]
        sent = fetch_connector_counters(prefill).get("bytes_sent", 0.0) - before
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": text_of(delta, seed + 7)}]
    return stats, sent


def measure(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    run_dir = Path(args.run_dir or f"/tmp/turnkv-link-{uuid.uuid4().hex[:6]}")
    with HostSet(["prefill", "decode"]) as hosts:
        config = ClusterConfig(
            mode="turnkv", model=args.model, dtype="float32", run_dir=run_dir,
            kv_cache_bytes=args.kv_cache_bytes, max_model_len=4096, short_delta_tokens=0,
            hosts={"prefill-0": hosts["prefill"], "decode-0": hosts["decode"]})
        launched = Cluster(config, console=console)
        with launched as state:
            prefill = next(e.url for e in state.engines if e.role == "prefill")
            alone_router, alone_url = start_router(launched, 10**6,
                                                   run_dir / "logs" / "router-alone.log")
            try:
                with httpx.Client(timeout=600) as client:
                    for repeat in range(args.repeat):
                        for rate in args.rates:
                            for name in ("prefill", "decode"):
                                hosts.unshape(name)
                                if rate:
                                    hosts.shape(name, rate)
                            for delta in args.deltas:
                                seed = repeat * 1000 + delta
                                push, sent = second_turn(
                                    client, state.router, state.served_model_name,
                                    args.history_tokens, delta, seed, prefill)
                                alone, _ = second_turn(
                                    client, alone_url, state.served_model_name,
                                    args.history_tokens, delta, seed + 1, prefill)
                                record = row(repeat, rate, delta, push, alone, sent)
                                console.print(record)
                                records.append(record)
            finally:
                alone_router.terminate()
                alone_router.wait(timeout=15)
    return records


def row(repeat: int, rate: float, delta: int, push: dict[str, Any], alone: dict[str, Any],
        sent: float) -> dict[str, Any]:
    """One measured pair of turns. With one token to generate, a turn's time to its reply
    (`total_ms`, from the router accepting it) is its time to first token."""
    return {
        "repeat": repeat, "rate_mbit": rate or None, "delta_tokens": delta,
        "push_computed": push["prompt_tokens"]["prefill_computed"],
        "push_compute_ms": push["times"]["engine_prefill_ms"],
        "push_bytes": sent,
        "push_ttft_ms": push["times"]["total_ms"],
        "alone_computed": alone["prompt_tokens"]["decode_computed"],
        "alone_compute_ms": alone["times"]["engine_prefill_ms"],
        "alone_ttft_ms": alone["times"]["total_ms"],
        "alone_served_alone": alone["prefill_node"] is None,
        # What pushing adds to the turn's first token, against serving it alone.
        "push_added_ms": push["times"]["total_ms"] - alone["times"]["total_ms"],
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


FIGURES = ("push_compute_ms", "push_bytes", "push_ttft_ms", "alone_compute_ms", "alone_ttft_ms",
           "push_added_ms")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rate and size: medians and ranges. Per rate, the crossover: the smallest measured
    delta from which (for it and every larger one measured) pushing added less to the turn's
    first token than the decode engine spends computing the delta alone, the time its other
    sessions' streams would wait; None where no such delta was measured."""
    rates: dict[str, Any] = {}
    for rate in dict.fromkeys(r["rate_mbit"] for r in records):
        sizes = {}
        for delta in sorted({r["delta_tokens"] for r in records}):
            rows = [r for r in records if r["rate_mbit"] == rate and r["delta_tokens"] == delta]
            sizes[str(delta)] = {f: spread([float(r[f]) for r in rows]) for f in FIGURES}
        measured = sorted(int(d) for d in sizes)
        pays = {int(d) for d, f in sizes.items()
                if f["push_added_ms"]["median"] < f["alone_compute_ms"]["median"]}
        crossover = next((d for d in measured if all(w in pays for w in measured if w >= d)),
                         None)
        rates["unshaped" if rate is None else f"{rate:g}"] = {
            "sizes": sizes, "push_pays_from_tokens": crossover}
    return rates


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    compute: list[float] = []
    deltas: list[int] = []
    for rate, data in summary.items():
        deltas = [int(d) for d in data["sizes"]]
        added = [max(f["push_added_ms"]["median"], 0.1) for f in data["sizes"].values()]
        label = "push adds, link unshaped" if rate == "unshaped" else f"push adds, {rate} Mbit/s"
        ax.plot(deltas, added, marker="o", label=label)
        compute = [f["alone_compute_ms"]["median"] for f in data["sizes"].values()]
    ax.plot(deltas, compute, marker="s", color="black", linestyle="--",
            label="decode engine busy computing it alone")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens the turn adds")
    ax.set_ylabel("ms (median of the repeats)")
    ax.set_title("Push a turn's KV across hosts, or compute it on the decode engine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(summary: dict[str, Any], console: Console) -> None:
    out = Table(title="Push across hosts vs serve alone, medians (ms)")
    for column in ("link", "tokens", "KV MB", "TTFT push", "TTFT alone", "push adds",
                   "decode compute"):
        out.add_column(column, justify="right")
    for rate, data in summary.items():
        for delta, f in data["sizes"].items():
            out.add_row(rate, delta, f"{f['push_bytes']['median'] / 1e6:.1f}",
                        f"{f['push_ttft_ms']['median']:.0f}",
                        f"{f['alone_ttft_ms']['median']:.0f}",
                        f"{f['push_added_ms']['median']:.0f}",
                        f"{f['alone_compute_ms']['median']:.0f}")
    console.print(out)
    for rate, data in summary.items():
        console.print(f"{rate}: pushing pays from {data['push_pays_from_tokens']} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rates", default="0,1000,100,10",
                        help="link rates in Mbit/s, comma-separated; 0: unshaped")
    parser.add_argument("--deltas", default="64,128,256,512,1024",
                        help="tokens each measured turn adds, comma-separated")
    parser.add_argument("--history-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.deltas = [int(d) for d in args.deltas.split(",")]
    console = Console(stderr=True)
    started = time.time()
    records = measure(args, console)
    summary = summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "link.json").write_text(json.dumps({
        "command": " ".join(["python", "scripts/link_crossover.py", *(argv or sys.argv[1:])]),
        "model": args.model, "history_tokens": args.history_tokens, "repeats": args.repeat,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "summary": summary, "records": records}, indent=1))
    plot(summary, args.out / "link.png")
    table(summary, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
