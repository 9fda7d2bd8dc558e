"""The table `turnkv up` and `turnkv status` print: each server of a cluster, where it
listens, its process, its cores, whether it lives and its log."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from turnkv_server.launcher.processes import ProcessRef
from turnkv_server.launcher.state import ClusterState


def status_table(state: ClusterState) -> Table:
    table = Table(title=f"turnkv cluster — mode {state.mode}, model {state.served_model_name}")
    servers = ([state.router_process] if state.router_process else []) + state.engines
    # At 80 columns (a log file, a small terminal) the URLs stay whole: one cut to
    # "http://127.0.0.1:…" cannot be used. Logs in the run folder's logs/ (printed whole below
    # the table) go by their file name.
    url_width = max((len(s.url) for s in servers), default=3)
    logs = Path(state.run_dir) / "logs"
    for column in ("server", "url", "pid", "cores", "alive"):
        table.add_column(column, no_wrap=True,
                         min_width=url_width if column == "url" else None)
    table.add_column("log", overflow="fold")
    for s in servers:
        alive = ProcessRef(pid=s.pid, create_time=s.create_time).is_alive()
        log = Path(s.log)
        table.add_row(s.name, s.url, str(s.pid), ",".join(map(str, s.cores)) or "-",
                      "[green]yes[/]" if alive else "[red]no[/]",
                      log.name if log.parent == logs else str(log))
    return table
