"""What one decode step costs an engine, per benchmark mode, by context length and batch.

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
from idle_cpu import busiest_threads, snapshot_threads  # this folder's
from rich.console import Console
from rich.table import Table

from turnkv_server.bench.plan import BenchSettings, cluster_config
from turnkv_server.launcher import Cluster
from turnkv_server.launcher.processes import raise_on_sigterm

SKIP_GAPS = 2  # the first token's gap and the step after it: the prompt's, not a decode step's


async def stream_gaps(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      tokens: int) -> list[float]:
    """Milliseconds between the streamed tokens of one request, its first gaps left out."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
    return gaps[SKIP_GAPS:]


async def measure(url: str, model: str, context: int, batch: int, tokens: int,
                  rng: random.Random, vocab: int) -> list[float]:
    """Every decode gap of `batch` requests run at once, each a fresh `context`-token prompt."""
    prompts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    async with httpx.AsyncClient(timeout=600) as client:
        runs = await asyncio.gather(*(stream_gaps(client, url, model, p, tokens)
                                      for p in prompts))
    return [gap for gaps in runs for gap in gaps]


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
    # mode -> "context x batch" -> per round, the median gap in ms
    medians: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
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
                            gaps = asyncio.run(measure(url, model, context, batch, args.tokens,
                                                       rng, args.vocab))
                            if (context, batch) == (max(contexts), max(batches)):
                                threads[mode].append(busiest_threads(
                                    before, snapshot_threads(pgid),
                                    time.monotonic() - started))
                            median = statistics.median(gaps)
                            medians[mode].setdefault(f"{context}x{batch}", []).append(median)
                            console.print(f"round {round_ + 1} {mode} context {context} batch "
                                          f"{batch}: median gap {median:.1f} ms")
                            write(args, medians, threads)  # what is measured is never lost
    table = Table(title="decode step, median gap ms (median of rounds, range)")
    table.add_column("context x batch")
    for mode in modes:
        table.add_column(mode, justify="right")
    base = modes[0]
    for key in medians[base]:
        row = [key]
        for mode in modes:
            values = medians[mode][key]
            ratio = statistics.median(values) / statistics.median(medians[base][key])
            row.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
                       f" {ratio:.2f}x")
        table.add_row(*row)
    Console().print(table)
    for mode in modes:
        for round_, rows in enumerate(threads[mode]):
            Console().print(f"{mode} round {round_ + 1}, busiest threads: " + ", ".join(
                f"{r['process']}/{r['thread']} {r['percent_of_a_core']}% "
                f"({r['wakeups_per_s']} wakeups/s)" for r in rows[:5]))
    write(args, medians, threads)


def write(args: argparse.Namespace, medians: dict[str, dict[str, list[float]]],
          threads: dict[str, list[list[dict[str, Any]]]]) -> None:
    result: dict[str, Any] = {"command": vars(args) | {"out": str(args.out)},
                              "median_gap_ms_by_round": medians,
                              "busiest_threads_longest_context": threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
