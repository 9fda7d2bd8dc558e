"""`turnkv sim`'s options (typer); the run is `sim.runner`'s, imported when the command runs
so that `turnkv --help` does not load SimPy or numpy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

PROFILE_HELP = ("calibrated:RESULTS.json (costs fitted from a turnkv bench run), or a GPU "
                "profile: h200-qwen3-32b, h100-qwen3-32b")


def sim(
    workload: Annotated[str, typer.Option(
        help="a bench preset (agent, conversation, agent-pressure, ...) or blog (vLLM's "
             "10-turn workload at --context tokens)")] = "agent",
    trace: Annotated[Path | None, typer.Option(
        help="sessions from a JSONL trace (docs/simulator.md) instead of --workload")] = None,
    mooncake: Annotated[Path | None, typer.Option(
        help="sessions from a Mooncake request trace (timestamp, input_length, "
             "output_length, hash_ids)")] = None,
    replay: Annotated[Path | None, typer.Option(
        help="a turnkv bench results.json: replay its --replay-mode run's turns")] = None,
    replay_mode: Annotated[str, typer.Option(help="the mode whose run --replay plays")] = (
        "affinity"),
    sessions: Annotated[int | None, typer.Option(
        help="this many sessions (a preset's or trace's shapes repeated as needed)",
        min=1)] = None,
    rate: Annotated[float | None, typer.Option(
        help="with --sessions: Poisson arrivals per second (default: all within 10 s)",
        min=0.0)] = None,
    context: Annotated[int, typer.Option(help="blog: the last turn's prompt tokens")] = 24_000,
    engines: Annotated[int, typer.Option(help="engines in the fleet", min=1)] = 2,
    policy: Annotated[list[str] | None, typer.Option(
        help="ROUTING[:EVICTION][+tier][+shared][@P:D], repeatable (default: affinity, "
             "standard, turnkv); e.g. turnkv+tier+shared, affinity:lease, standard@1:3")] = None,
    tier_tokens: Annotated[int, typer.Option(
        help="host tier per engine, in tokens, for +tier policies", min=0)] = 0,
    profile: Annotated[str, typer.Option(help=PROFILE_HELP)] = "h200-qwen3-32b",
    kv_cache_tokens: Annotated[int | None, typer.Option(
        help="each engine's KV cache (default: the profile's)", min=1)] = None,
    per_engine: Annotated[str | None, typer.Option(
        help="a fleet-sizing sweep: sessions per engine, comma-separated (2,4,8,16)")] = None,
    lose: Annotated[list[str] | None, typer.Option(
        help="ENGINE@SECONDS: lose engine ENGINE (its index) at that time; repeatable")] = (
        None),
    admission_tokens: Annotated[int | None, typer.Option(
        help="the router's admission budget (tokens of live history)", min=1)] = None,
    itl_target_ms: Annotated[float | None, typer.Option(
        help="turnkv's planner: the ITL target", min=0.0)] = None,
    validate: Annotated[list[Path] | None, typer.Option(
        help="bench results.json to validate against (repeatable): the table of bench vs "
             "sim for affinity, standard and turnkv; nothing else runs")] = None,
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("sim-out"),
) -> None:
    """Simulate a fleet serving multi-turn sessions under turnkv's own policies; write
    results.json, summary.md and plots."""
    from turnkv_server.sim.runner import SimOptions, run_sim

    try:
        run_sim(SimOptions(
            workload=workload, trace=trace, mooncake=mooncake, replay=replay,
            replay_mode=replay_mode, sessions=sessions, rate=rate, context=context,
            engines=engines, policies=tuple(policy or ()), tier_tokens=tier_tokens,
            profile=profile, kv_cache_tokens=kv_cache_tokens, per_engine=per_engine,
            lose=tuple(lose or ()), admission_tokens=admission_tokens,
            itl_target_ms=itl_target_ms, validate=tuple(validate or ()), seed=seed, out=out))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
