"""A local cluster: vLLM engines on their own cores plus the client-facing front.

One launcher serves the demo, the tests and the benchmark. `Cluster` is a context manager:
whatever happens while it starts or runs, leaving the block stops every process it started.

Ports: every server binds port 0 and reports the port it got (`turnkv_server.ports`), so
nothing can take a port between its choice and its bind; the router starts once the engines
have reported theirs.

Each engine's KV connector settings (vLLM's `--kv-transfer-config`) come from `kv_transfer`;
where each process runs (here, or on a simulated host: `ClusterConfig.hosts`) from
`placement`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from turnkv_server import local_http
from turnkv_server.launcher import placement
from turnkv_server.launcher.config import VLLM_CACHE_ENV, ClusterConfig
from turnkv_server.launcher.engine import (
    EngineProcess,
    EngineSpec,
    EngineStartError,
    read_tail,
    resolve_dtype,
)
from turnkv_server.launcher.kv_transfer import disk_tier, kv_transfer_config, shared_tier
from turnkv_server.launcher.processes import ProcessRef, stop_group
from turnkv_server.launcher.progress import LogPhases, StartupDisplay
from turnkv_server.launcher.state import ClusterState, ServerState, clear_current, set_current
from turnkv_server.launcher.tool_calling import resolve_parser
from turnkv_server.paths import turnkv_home
from turnkv_server.ports import read_report


class ClusterStartError(RuntimeError):
    """The cluster could not start; every process it had started is already stopped."""


class Cluster:
    """Start with `with Cluster(config) as state:` or `start()` / `stop()`."""

    def __init__(self, config: ClusterConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console(stderr=True)
        self.run_dir = config.run_dir or _new_run_dir()
        self.vllm_cache_dir = config.vllm_cache_dir or Path(
            os.environ.get(VLLM_CACHE_ENV) or self.run_dir / "vllm-cache")
        self.engines: list[EngineProcess] = []
        self.router_ref: ProcessRef | None = None
        self.state: ClusterState | None = None
        self.router_port_file = self.run_dir / "router.addr"
        # Per cluster: an engine of another cluster on this machine cannot talk to these.
        self.side_channel_secret = config.side_channel_secret or secrets.token_hex(32)
        self.tool_calling = ""  # why the engines run the tool-call parser they run

    def __enter__(self) -> ClusterState:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start -----------------------------------------------------------------------------

    def start(self) -> ClusterState:
        from turnkv_server.models import resolve_model

        began = time.monotonic()
        steps = 3 if self.config.mode == "single" else 4
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._step(1, steps, f"model {self.config.model}")
        model_path = resolve_model(self.config.model, progress=self._note)
        served_name = _served_name(self.config.model, model_path)
        self._note(f"{served_name}: {model_path}")
        specs = self._engine_specs(model_path, served_name)
        parser = specs[0].tool_call_parser
        self._note(f"tool calling: {f'vLLM parser {parser}' if parser else 'off'} "
                   f"({self.tool_calling})")
        self.engines = [EngineProcess(spec, self.run_dir) for spec in specs]
        try:
            self._step(2, steps, f"starting {len(specs)} vLLM engine(s), {self.config.mode} mode")
            self._note("each imports vLLM, loads the weights and allocates its KV cache")
            self._note(f"their logs: {self.run_dir / 'logs'}")
            for engine in self.engines:
                engine.start()
            self._wait_for_engines()
            self._step(3, steps, "pinning every engine thread to its cores")
            self._pin_engines()
            if steps == 4:
                self._step(4, steps, "starting the router")
            router_url = self._start_router(served_name)
        except BaseException:
            self.stop()
            raise
        self.state = self._record(served_name, model_path, router_url)
        self._note(f"cluster ready in {time.monotonic() - began:.0f} s")
        return self.state

    def _engine_specs(self, model_path: Path, served_name: str) -> list[EngineSpec]:
        cfg = self.config
        roles = cfg.roles()
        # 0: the engine binds a free port and reports it.
        ports = cfg.engine_ports or [0] * len(roles)
        if len(ports) != len(roles):
            raise ValueError(f"{len(roles)} engines need {len(roles)} ports, got {len(ports)}")
        # Only engines with a KV connector have a side channel.
        nixl_ports: list[int | None] = [None if role == "single" or (
            role == "engine" and not cfg.engine_leases) else 0 for role in roles]
        cores = _core_sets(len(roles), cfg.cores_per_engine)
        # Unique per start: NIXL refuses a restarted peer that reuses its agent's name.
        run_tag = uuid.uuid4().hex[:8]
        parser, self.tool_calling = resolve_parser(cfg.tool_call_parser, model_path)
        shared = self._shared_tier()
        specs = []
        for name, role, port, nixl_port, core_set in zip(
                cfg.engine_names(), roles, ports, nixl_ports, cores, strict=True):
            host = (cfg.hosts or {}).get(name)
            specs.append(
                EngineSpec(
                    name=name,
                    role=role,
                    model=model_path,
                    served_model_name=served_name,
                    port=port,
                    host=placement.bind_address(host),
                    placed_on=host,
                    cores=core_set,
                    nixl_port=nixl_port,
                    kv_transfer_config=kv_transfer_config(
                        cfg.mode, role, f"turnkv-{name}-{run_tag}", cfg.decoder_kv_ttl,
                        cfg.kv_recompute_threshold, cfg.connector_settings,
                        cfg.tier_host_blocks, cfg.engine_leases, self._disk_tier(), shared),
                    dtype=resolve_dtype(cfg.dtype),
                    prefix_caching=cfg.prefill_cache or role != "prefill",
                    kv_cache_bytes=cfg.kv_cache_bytes,
                    max_model_len=cfg.max_model_len,
                    block_size=cfg.block_size,
                    tool_call_parser=parser,
                    extra_args=cfg.engine_extra_args,
                    side_channel_secret=(self.side_channel_secret
                                         if cfg.mode == "turnkv" or cfg.engine_leases else None),
                    vllm_cache_dir=self.vllm_cache_dir,
                )
            )
        return specs

    def _disk_tier(self) -> dict[str, Any] | None:
        """The engines' disk tier, if asked for: each engine's files in a folder of its own
        under the run folder's `tier-disk`."""
        size = self.config.tier_disk_bytes
        return None if size is None else disk_tier(str(self.run_dir / "tier-disk"), size)

    def _shared_tier(self) -> dict[str, Any] | None:
        """The file tier every engine reads and writes, if the cluster has one: the run
        folder's `tier-shared`, emptied here (its files are found by name, and a file of an
        earlier cluster's must never be) and removed at stop."""
        if not self.config.shares_tier():
            return None
        folder = shared_tier_dir(self.run_dir)
        shutil.rmtree(folder, ignore_errors=True)
        return shared_tier(str(folder))

    def _wait_for_engines(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        logs = {e.spec.name: LogPhases(e.log_path, e.log_offset) for e in self.engines}
        with StartupDisplay(self.console, list(logs)) as display:
            pending = list(self.engines)
            while pending:
                for engine in list(pending):
                    elapsed = time.monotonic() - engine.started_at
                    if engine.is_healthy():
                        pending.remove(engine)
                        display.serving(engine.spec.name, engine.spec.url, elapsed)
                    else:
                        display.update(engine.spec.name, logs[engine.spec.name].poll(), elapsed)
                if pending and time.monotonic() > deadline:
                    timeout = self.config.startup_timeout
                    raise EngineStartError(
                        pending[0].spec.name,
                        f"not healthy after {timeout:.0f} s",
                        pending[0].log_path,
                        pending[0].log_tail(),
                    )
                time.sleep(0.5)

    def _pin_engines(self) -> None:
        for engine in self.engines:
            strays = engine.pin()
            if strays:
                self._note(
                    f"warning: {len(strays)} thread(s) of {engine.spec.name} could not be pinned "
                    f"to cores {list(engine.spec.cores)}"
                )

    def _start_router(self, served_name: str) -> str:
        if self.config.mode == "single":
            return self.engines[0].spec.url
        self.router_port_file.unlink(missing_ok=True)
        cmd = self.router_command(self.config.router_port or 0, self.router_port_file)
        log_path = self.run_dir / "logs" / "router.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.router_ref = ProcessRef.of(popen.pid)
        url: str | None = None
        deadline = time.monotonic() + 30
        while True:
            if popen.poll() is not None:
                raise ClusterStartError(
                    f"router exited with code {popen.returncode}; last lines of {log_path}:\n"
                    + read_tail(log_path, 30)
                )
            if url is None:
                bound = read_report(self.router_port_file)
                if bound is not None:
                    url = f"http://{bound[0]}:{bound[1]}"
            if url is not None and local_http.answers_health(url):
                return url
            if time.monotonic() > deadline:
                raise ClusterStartError(f"router not healthy after 30 s; see {log_path}")
            time.sleep(0.2)

    def router_command(self, port: int = 0, port_file: Path | None = None) -> list[str]:
        """The command line of a router in front of this cluster's engines (once healthy), on
        `port` (0: a free one, reported in `port_file`): the launcher's, or one sharing its
        sessions (`--redis` in `router_args`). With a "router" in `hosts`, it runs on that
        host and listens on its address."""
        cfg, mode = self.config, str(self.config.mode)
        if mode == "standard" and not self.config.prefill_cache:
            mode = "standard-nocache"
        host = (cfg.hosts or {}).get(placement.ROUTER)
        cmd = [sys.executable, "-m", "turnkv_server.router",
               "--host", placement.bind_address(host), "--port", str(port), "--mode", mode,
               "--decoder-kv-ttl", str(self.config.decoder_kv_ttl)]
        if port_file is not None:
            cmd += ["--port-file", str(port_file)]
        if self.config.short_delta_tokens is not None:
            cmd += ["--short-delta-tokens", str(self.config.short_delta_tokens)]
        cmd += [*self.config.router_args, *(["--engine-leases"] if cfg.engine_leases else []),
                *(["--shared-tier"] if cfg.shares_tier() else [])]
        for engine in self.engines:
            spec = engine.spec
            # An affinity router serves every turn on one engine, whatever role it was
            # started in (the tests put one in front of running decode engines).
            cmd += ["--engine" if mode == "affinity" else f"--{spec.role}", spec.url]
            if spec.kv_transfer_config and spec.nixl_port and (
                    spec.role == "prefill" or mode == "turnkv"):
                engine_id = spec.kv_transfer_config["engine_id"]
                cmd += [f"--{spec.role}-nixl", f"{engine_id}@{spec.host}:{spec.nixl_port}"]
        # On a host, `ip netns exec` execs the router: its PID is still the router's.
        return placement.wrap(host, cmd)

    def _record(self, served_name: str, model_path: Path, router_url: str) -> ClusterState:
        router = None
        if self.router_ref is not None:
            router = ServerState(name="router", role="router", url=router_url,
                                 pid=self.router_ref.pid,
                                 create_time=self.router_ref.create_time,
                                 log=str(self.run_dir / "logs" / "router.log"))
        engines = [e.server_state() for e in self.engines]
        state = ClusterState(
            mode=self.config.mode,
            model=str(model_path),
            served_model_name=served_name,
            run_dir=str(self.run_dir),
            router=router_url,
            engines=engines,
            router_process=router,
        )
        state.save()
        if self.config.register_as_current:
            set_current(self.run_dir)
        return state

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        if self.router_ref is not None:
            stop_group(self.router_ref)
            self.router_ref = None
        for engine in self.engines:
            engine.stop()
            engine.release_ports()
            remove_offload_region((engine.spec.kv_transfer_config or {}).get("engine_id"))
        shutil.rmtree(shared_tier_dir(self.run_dir), ignore_errors=True)
        if self.config.register_as_current:
            clear_current(self.run_dir)

    def _note(self, message: str) -> None:
        self.console.print(f"[dim]{escape(message)}[/]")

    def _step(self, index: int, steps: int, message: str) -> None:
        # soft_wrap: one line per step in a log file too, however long.
        self.console.print(f"[bold]{escape(f'[{index}/{steps}]')}[/] {escape(message)}",
                           highlight=False, soft_wrap=True)


def stop_cluster(state: ClusterState) -> None:
    """Stop the processes recorded in a state file (the `turnkv down` path)."""
    servers = ([state.router_process] if state.router_process else []) + state.engines
    for server in servers:
        stop_group(ProcessRef(pid=server.pid, create_time=server.create_time),
                   shared_memory=server.shared_memory)
    for engine in state.engines:
        remove_offload_region(engine.engine_id)
    shutil.rmtree(shared_tier_dir(Path(state.run_dir)), ignore_errors=True)
    clear_current(Path(state.run_dir))


def remove_offload_region(engine_id: str | None) -> None:
    """An engine's host tier under vLLM's tiering lives in a file in /dev/shm named by its
    engine ID (upstream `cpu/shared_offload_region.py`), which vLLM removes only when the
    engine closes it: a stopped engine leaves it behind, as big as its tier. None: the
    engine loads no connector, and has no region."""
    if engine_id:
        Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)


def shared_tier_dir(run_dir: Path) -> Path:
    """Where a cluster's engines share their file tier (`ClusterConfig.tier_shared`)."""
    return run_dir / "tier-shared"


def _core_sets(count: int, per_engine: int) -> list[tuple[int, ...]]:
    """Give each engine its own cores, wrapping around when engines outnumber cores."""
    cores = sorted(os.sched_getaffinity(0))
    starts = [(i * per_engine) % len(cores) for i in range(count)]
    return [tuple(cores[(start + j) % len(cores)] for j in range(per_engine)) for start in starts]


def _served_name(requested: str, path: Path) -> str:
    from turnkv_server.models import SMOLLM2, TINY

    if requested.lower() in ("smollm2", SMOLLM2):
        return SMOLLM2
    if requested.lower() == TINY:
        return TINY
    return path.name


def _new_run_dir() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = turnkv_home() / "runs"
    for n in range(1000):
        candidate = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run folder under {base}")

