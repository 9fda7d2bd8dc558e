"""Ports: each server binds port 0 and reports the port it got (`turnkv_server.ports`): the
report files, the hold that keeps a restarted server's port, the engine wrapper, the router,
and upstream's NIXL listener (`nixl_tuning`)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from turnkv_server.launcher import serve_engine
from turnkv_server.ports import (
    SIDE_CHANNEL_REPORT_ENV,
    PortHold,
    bind_listener,
    format_address,
    parse_address,
    read_report,
    write_report,
)


def _can_bind(port: int, *, reuse: bool = False) -> bool:
    with socket.socket() as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
        return True


def test_addresses_and_reports(tmp_path: Path) -> None:
    assert parse_address("127.0.0.1:5600") == ("127.0.0.1", 5600)
    assert parse_address("[::1]:80\n") == ("::1", 80)
    assert format_address("::1", 80) == "[::1]:80"
    for bad in ("127.0.0.1", ":80", "h:0", "h:70000", "h:x", ""):
        with pytest.raises(ValueError):
            parse_address(bad)
    report = tmp_path / "side.addr"
    assert read_report(report) is None  # not bound yet
    write_report(report, "127.0.0.1", 41234)
    assert read_report(report) == ("127.0.0.1", 41234)
    assert [p.name for p in tmp_path.iterdir()] == ["side.addr"]  # no temporary file left
    report.write_text("garbage")
    with pytest.raises(ValueError):
        read_report(report)


def test_a_listener_on_port_0_keeps_its_port_from_everyone() -> None:
    with bind_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port != 0
        # Listening: not even a bind that shares addresses (SO_REUSEADDR) gets it.
        assert not _can_bind(port) and not _can_bind(port, reuse=True)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # waits in the backlog until the server accepts


def test_a_held_port_is_kept_for_the_server_it_is_held_for() -> None:
    with PortHold("127.0.0.1", [0]) as hold:
        (port,) = hold.ports
        # Not for anyone else: a bind without SO_REUSEADDR fails...
        assert not _can_bind(port)
        # ...but the server binds it as servers do (vLLM, uvicorn and ZeroMQ set SO_REUSEADDR).
        with bind_listener("127.0.0.1", port):
            # A port that is taken is not held: the server's own bind says so.
            assert PortHold("127.0.0.1", [port]).missing == [port]
    assert _can_bind(port)  # released


# -- the engine wrapper (serve_engine) ---------------------------------------------------------


def test_the_wrapper_reads_its_arguments() -> None:
    path, rest = serve_engine.split_args(["--port-file", "/r/http.addr", "--model", "m"])
    assert path == Path("/r/http.addr") and rest == ["--model", "m"]
    assert serve_engine.split_args(["--port-file=/f", "--port", "0"]) == (Path("/f"),
                                                                          ["--port", "0"])
    with pytest.raises(serve_engine.UsageError):
        serve_engine.split_args(["--model", "m"])
    args = ["--host", "127.0.0.1", "--port", "0", "--port=7", "--model", "m"]
    assert serve_engine.option(args, "--port") == "7"  # the last one, as argparse
    assert serve_engine.with_option(args, "--port", "41000") == [
        "--host", "127.0.0.1", "--model", "m", "--port", "41000"]
    assert serve_engine.listen_address(args) == ("127.0.0.1", 7)
    assert serve_engine.listen_address(["--model", "m"]) == ("", 8000)  # vLLM's defaults
    with pytest.raises(serve_engine.UsageError):
        serve_engine.listen_address(["--uds", "/s"])
    with pytest.raises(serve_engine.UsageError):
        serve_engine.listen_address(["--port", "x"])


def test_the_wrapper_hands_vllm_the_socket_it_bound(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM replaced by a stand-in that does what its `setup_server` does with the arguments:
    ask `launcher.create_server_socket` for (host, port)."""
    launcher = types.ModuleType("vllm.entrypoints.launchers.launcher")

    def own_bind(addr: tuple[str, int], *, reuse_port: bool) -> socket.socket:
        raise AssertionError("vLLM bound a socket of its own")

    launcher.create_server_socket = own_bind  # type: ignore[attr-defined]
    served: dict[str, object] = {}

    def vllm_main() -> None:
        args = sys.argv[1:]
        addr = (serve_engine.option(args, "--host") or "", int(serve_engine.option(args, "--port")
                                                             or 8000))
        served["sock"] = launcher.create_server_socket(addr, reuse_port=False)
        served["args"] = args

    entry = types.ModuleType("vllm.entrypoints.launchers.api_server.entry")
    entry.main = vllm_main  # type: ignore[attr-defined]
    package = types.ModuleType("vllm.entrypoints.launchers")
    package.launcher = launcher  # type: ignore[attr-defined]
    api_server = types.ModuleType("vllm.entrypoints.launchers.api_server")
    api_server.entry = entry  # type: ignore[attr-defined]
    for module in (package, launcher, api_server, entry):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(sys, "argv", ["serve_engine"])
    report = tmp_path / "http.addr"

    serve_engine.main(["--port-file", str(report), "--model", "m", "--host", "127.0.0.1",
                       "--port", "0"])
    sock = served["sock"]
    assert isinstance(sock, socket.socket)
    with sock:
        host, port = read_report(report) or ("", 0)
        assert (host, port) == sock.getsockname() and port != 0
        # vLLM sees the port it serves on, never 0, and none of the wrapper's arguments.
        assert served["args"] == ["--model", "m", "--host", "127.0.0.1", "--port", str(port)]
        assert not _can_bind(port, reuse=False)  # bound before vLLM ran
        # Not listening until vLLM serves: a request sent while the engine starts is refused
        # at once, not held in a backlog until the engine is up.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(RuntimeError, match="holds"):
        serve_engine.adopter(sock, "127.0.0.1", port)(("127.0.0.1", port + 1), reuse_port=False)


def test_vllm_still_binds_its_server_socket_where_the_wrapper_expects() -> None:
    """The two vLLM 0.32 internals the wrapper relies on, read from vLLM's source (importing
    it takes seconds): `setup_server` binds through `create_server_socket`, and `entry.main`
    is what `python -m vllm.entrypoints.openai.api_server` runs."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(spec.submodule_search_locations[0]) / "entrypoints"
    launcher = (root / "launchers" / "launcher.py").read_text()
    setup_server = launcher[launcher.index("def setup_server"):]
    assert "sock = create_server_socket(sock_addr" in setup_server
    assert "sock_addr = (args.host or \"\", args.port)" in setup_server
    entry = (root / "launchers" / "api_server" / "entry.py").read_text()
    assert "def main():" in entry and "setup_server(args" in entry
    assert "api_server.entry import main" in (root / "openai" / "api_server.py").read_text()


# -- the router ---------------------------------------------------------------------------------


def test_the_router_binds_port_0_and_reports_it(tmp_path: Path) -> None:
    report = tmp_path / "router.addr"
    router = subprocess.Popen(
        [sys.executable, "-m", "turnkv_server.router", "--mode", "standard",
         "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
         "--port", "0", "--port-file", str(report)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while (bound := read_report(report)) is None:
            assert router.poll() is None, router.communicate()[0].decode()
            assert time.monotonic() < deadline, "no report"
            time.sleep(0.05)
        host, port = bound
        assert host == "127.0.0.1" and port != 0
        while True:
            try:
                # Degraded (no engine there), but it is this router answering.
                answer = httpx.get(f"http://{host}:{port}/health", timeout=5)
                break
            except httpx.TransportError:
                assert router.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert json.loads(answer.text)["mode"] == "standard"
    finally:
        router.terminate()
        router.wait(timeout=15)


# -- upstream's NIXL side channel (nixl_tuning) -------------------------------------------------


def test_upstreams_nixl_listener_binds_a_free_port_and_reports_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own handshake listener, started as its engine core starts it, on port 0: it
    serves a peer's handshake on the port reported, the one its requests advertise."""
    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        NixlHandshakePayload,
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    from turnkv_server.engine import nixl_tuning

    report = tmp_path / "side.addr"
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    monkeypatch.setenv(SIDE_CHANNEL_REPORT_ENV, str(report))
    # The scheduler half as its constructor leaves it, minus what a listener does not use.
    scheduler = object.__new__(NixlPullConnectorScheduler)
    scheduler.vllm_config = SimpleNamespace(  # type: ignore[assignment]
        parallel_config=SimpleNamespace(data_parallel_size=1))
    scheduler.side_channel_host = "127.0.0.1"
    scheduler.side_channel_port = 0
    scheduler._nixl_handshake_listener_t = None
    scheduler._stop_event = threading.Event()
    connector = object.__new__(nixl_tuning.NixlConnector)
    connector.connector_scheduler = scheduler
    payload = NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"agent")
    context = zmq.Context()
    try:
        connector.set_xfer_handshake_metadata_pp_aware({(0, 0): payload})
        bound = read_report(report)
        assert bound is not None
        host, port = bound
        assert port == scheduler.side_channel_port != 0
        # A peer's handshake, as vLLM's worker sends it.
        peer = context.socket(zmq.REQ)
        peer.setsockopt(zmq.RCVTIMEO, 5000)
        peer.connect(f"tcp://{host}:{port}")
        peer.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        reply = peer.recv_multipart()
        assert msgspec.msgpack.decode(reply[0], type=NixlHandshakePayload) == payload
        assert not _can_bind(port, reuse=True)  # the listener's now, not a hold's
    finally:
        context.destroy(linger=0)
        scheduler._stop_event.set()
        if scheduler._nixl_handshake_listener_t is not None:
            scheduler._nixl_handshake_listener_t.join(timeout=5)
