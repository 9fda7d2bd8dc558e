"""What one decode step, and the prompt before it, cost an engine, per benchmark mode, by
context length and batch.

Each mode's first engine is started as `turnkv bench` starts it (the same connectors, host tier
and cores), and sent --batch requests at once straight to its HTTP API, each a prompt of
--context random token IDs that no other request shares, decoding --tokens tokens. A step's cost
is the gap between two streamed tokens at the client; the first gaps (the prompt's computation
and the step after it) are left out. Modes are interleaved, --repeat rounds, a fresh cluster
each time, so that a difference between modes is the engines' own per-step work, not the load:
nothing else runs on the engine. Beside each mode's figures, the engine's threads that spent the
most CPU while it decoded the longest contexts (where its per-step work goes).

    python scripts/decode_step_cost.py --modes affinity-offload,turnkv --context 512,8000 \\
        --batch 1,2 --out docs/bench/decode-step-cost.json

A mode may carry environment variables for its engines, `MODE@NAME=VALUE[@NAME=VALUE...]`
(`turnkv@UCX_MEM_EVENTS=n`): the same mode with one setting changed, measured beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from idle_cpu import Threads, busiest_threads, snapshot_threads  # this folder's
from rich.console import Console
from rich.table import Table

from turnkv_server.bench.plan import BenchSettings, cluster_config
from turnkv_server.launcher import Cluster
from turnkv_server.launcher.processes import raise_on_sigterm

SKIP_GAPS = 2  # the first token's gap and the step after it: the prompt's, not a decode step's


async def stream_gaps(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      tokens: int) -> tuple[float, list[float]]:
    """Milliseconds to the first streamed token of one request, and between its streamed
    tokens, its first gaps left out."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    arrivals: list[float] = []
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
    return (arrivals[0] - sent) * 1000, gaps[SKIP_GAPS:]


async def measure(url: str, model: str, context: int, batch: int, tokens: int,
                  rng: random.Random, vocab: int) -> tuple[list[float], list[float]]:
    """Each request's time to its first token, and every decode gap, of `batch` requests run
    at once, each a fresh `context`-token prompt."""
    prompts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    async with httpx.AsyncClient(timeout=600) as client:
        runs = await asyncio.gather(*(stream_gaps(client, url, model, p, tokens)
                                      for p in prompts))
    return [first for first, _ in runs], [gap for _, gaps in runs for gap in gaps]


def cpu_ms(before: Threads, after: Threads) -> float:
    """The CPU time the group's threads spent between two snapshots."""
    return 1000 * sum(cpu - before.get(key, (0.0, 0))[0] for key, (cpu, _) in after.items())


def split_mode(spec: str) -> tuple[str, dict[str, str]]:
    """'MODE@NAME=VALUE@...' -> the bench mode and the environment its engines get."""
    mode, *settings = spec.split("@")
    env = dict(setting.split("=", 1) for setting in settings)
    return mode, env


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment, which the launcher hands its engines."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="affinity-offload,turnkv")
    parser.add_argument("--context", default="512,8000",
                        help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--batch", default="1,2", help="requests decoding at once")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each request decodes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tier-host-blocks", type=int, default=153,
                        help="the host tier of the modes that have one, in blocks")
    parser.add_argument("--vocab", type=int, default=49_000,
                        help="prompts draw token IDs below this")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    contexts = [int(c) for c in args.context.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    settings = BenchSettings(tier_host_blocks=args.tier_host_blocks)
    console = Console(stderr=True)
    raise_on_sigterm()  # a killed run still stops its clusters
    rng = random.Random(0)
    # mode -> "context x batch" -> per round: the median gap, the median time to the first
    # token, the engine's CPU time over the measurement (all in ms)
    medians: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    firsts: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    cpus: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    threads: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="decode-step-") as tmp:
        for round_ in range(args.repeat):
            for mode in modes:
                run_dir = Path(tmp) / f"mode{modes.index(mode)}-round{round_}"
                bench_mode, env = split_mode(mode)
                config = cluster_config(bench_mode, settings, run_dir)
                with environment(env), Cluster(config, console) as state:
                    url, model = state.engines[0].url, state.served_model_name
                    pgid = state.engines[0].pid  # the launcher starts each in its own group
                    for context in contexts:
                        for batch in batches:
                            before, started = snapshot_threads(pgid), time.monotonic()
                            first, gaps = asyncio.run(measure(url, model, context, batch,
                                                              args.tokens, rng, args.vocab))
                            after = snapshot_threads(pgid)
                            if (context, batch) == (max(contexts), max(batches)):
                                threads[mode].append(busiest_threads(
                                    before, after, time.monotonic() - started))
                            key = f"{context}x{batch}"
                            median = statistics.median(gaps)
                            medians[mode].setdefault(key, []).append(median)
                            firsts[mode].setdefault(key, []).append(statistics.median(first))
                            cpus[mode].setdefault(key, []).append(cpu_ms(before, after))
                            console.print(f"round {round_ + 1} {mode} context {context} batch "
                                          f"{batch}: median gap {median:.1f} ms, first token "
                                          f"{firsts[mode][key][-1]:.0f} ms, engine CPU "
                                          f"{cpus[mode][key][-1]:.0f} ms")
                            write(args, medians, firsts, cpus, threads)  # never lost
    for title, values in (("decode step, median gap ms", medians),
                          ("first token, median ms", firsts),
                          ("engine CPU over the measurement, ms", cpus)):
        print_table(f"{title} (median of rounds, range)", modes, values)
    for mode in modes:
        for round_, rows in enumerate(threads[mode]):
            Console().print(f"{mode} round {round_ + 1}, busiest threads: " + ", ".join(
                f"{r['process']}/{r['thread']} {r['percent_of_a_core']}% "
                f"({r['wakeups_per_s']} wakeups/s)" for r in rows[:5]))
    write(args, medians, firsts, cpus, threads)


def print_table(title: str, modes: list[str], values: dict[str, dict[str, list[float]]]
                ) -> None:
    """One row per "context x batch", one column per mode: the median of its rounds, their
    range, and its ratio to the first mode's."""
    table = Table(title=title)
    table.add_column("context x batch")
    for mode in modes:
        table.add_column(mode, justify="right")
    base = modes[0]
    for key in values[base]:
        row = [key]
        for mode in modes:
            rounds = values[mode][key]
            ratio = statistics.median(rounds) / statistics.median(values[base][key])
            row.append(f"{statistics.median(rounds):.1f} ({min(rounds):.1f}-{max(rounds):.1f})"
                       f" {ratio:.2f}x")
        table.add_row(*row)
    Console().print(table)


def write(args: argparse.Namespace, medians: dict[str, dict[str, list[float]]],
          firsts: dict[str, dict[str, list[float]]], cpus: dict[str, dict[str, list[float]]],
          threads: dict[str, list[list[dict[str, Any]]]]) -> None:
    result: dict[str, Any] = {"command": vars(args) | {"out": str(args.out)},
                              "median_gap_ms_by_round": medians,
                              "first_token_ms_by_round": firsts,
                              "engine_cpu_ms_by_round": cpus,
                              "busiest_threads_longest_context": threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
