"""Measure the `/tokenize` round trip the planner makes for a turn whose home is busy.

The `turnkv` mode reads a prompt's length (a `/tokenize` request to the pair's other engine)
before it weighs a split or a move. This starts a local `turnkv` cluster, then times that
request for a chat prompt of about `--words` words on one engine, first idle, then while the
same engine decodes two streamed requests (its API server shares the engine's core).

    python scripts/tokenize_cost.py [--model smollm2] [--words 2200] [--requests 20]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from turnkv_server.launcher import Cluster, ClusterConfig

WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
         "by", "on", "not", "he", "this", "are", "or", "his")
DECODING = 2  # streamed requests the engine decodes during the second measurement


def chat(words: int, seed: int) -> list[dict[str, str]]:
    rnd = random.Random(seed)
    text = " ".join(rnd.choice(WORDS) for _ in range(words))
    return [{"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": text}]


async def measure(engine: str, model: str, words: int, requests: int,
                  console: Console) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=120) as client:
        async def tokenize(seed: int) -> tuple[float, int]:
            start = time.perf_counter()
            reply = await client.post(f"{engine}/tokenize", json={
                "model": model, "messages": chat(words, seed), "add_generation_prompt": True})
            reply.raise_for_status()
            return (time.perf_counter() - start) * 1000, len(reply.json()["tokens"])

        async def decode(seed: int) -> None:
            body = {"model": model, "messages": chat(words * 2 // 3, seed), "max_tokens": 300,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{engine}/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass

        idle = [await tokenize(i) for i in range(requests)]
        decodes = [asyncio.create_task(decode(100 + i)) for i in range(DECODING)]
        await asyncio.sleep(4)  # past their prompts: decoding
        busy = []
        for i in range(requests):
            busy.append(await tokenize(1000 + i))
            await asyncio.sleep(0.2)
        await asyncio.gather(*decodes)
    result = {"prompt_tokens": idle[0][1], "requests": requests,
              "idle_median_ms": round(statistics.median(ms for ms, _ in idle), 1),
              "idle_max_ms": round(max(ms for ms, _ in idle), 1),
              "decoding_median_ms": round(statistics.median(ms for ms, _ in busy), 1),
              "decoding_max_ms": round(max(ms for ms, _ in busy), 1)}
    console.print(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--words", type=int, default=2200)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="turnkv-tokenize-") as run_dir:
        config = ClusterConfig(mode="turnkv", model=args.model, run_dir=Path(run_dir))
        with Cluster(config, console=console) as state:
            urls = state.endpoints()
            engine = urls["decode"][0]  # type: ignore[index]
            asyncio.run(measure(engine, state.served_model_name, args.words, args.requests,
                                console))


if __name__ == "__main__":
    main()
