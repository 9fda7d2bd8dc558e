"""A real redis-server for the tests, stopped by its PID.

`redis_server`: on a Unix socket. A socket in a folder of the test's own needs no port: a TCP
port chosen free here could be taken before redis-server binds it (redis cannot bind port 0
and report it: `--port 0` turns TCP off). Routers reach it as ``unix://PATH?db=0`` (redis-py's
URL form).

`redis_server_on`: on a simulated host (`turnkv_server.launcher.hosts`), over TCP on the
host's address, for routers on other hosts. A fixed port is safe there: nothing else listens
inside the host's namespace.

`make test` installs Debian's redis-server (the Makefile's `redis` target).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis

from turnkv_server.launcher.host_plan import Host

REDIS_PORT = 6379
# No persistence: the tests' sessions live as long as the server.
_EPHEMERAL = ("--save", "", "--appendonly", "no")


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: `make test` installs it "
                           "(apt-get install redis-server)")
    return binary


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """Start redis-server (no persistence, no TCP, a socket only this user can open); yields
    its URL. Its log goes to `folder`."""
    # A Unix socket's path has at most 107 bytes, and pytest's folders can be longer.
    socket_dir = Path(tempfile.mkdtemp(prefix="turnkv-redis-"))
    socket_path = socket_dir / "redis.sock"
    argv = [_binary(), "--port", "0", "--unixsocket", str(socket_path), "--unixsocketperm",
            "700", *_EPHEMERAL, "--dir", str(folder)]
    try:
        with _serving(argv, f"unix://{socket_path}?db=0", folder / "redis.log") as url:
            yield url
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


@contextmanager
def redis_server_on(host: Host, folder: Path, port: int = REDIS_PORT) -> Iterator[str]:
    """Start redis-server inside simulated host `host`, listening on its address only (no
    persistence); yields its URL. Its log goes to `folder`."""
    # Protected mode refuses clients from other addresses when there is no password: the
    # simulated range is reachable from this machine only (`launcher.hosts`).
    argv = host.argv([_binary(), "--bind", str(host.address), "--port", str(port),
                      "--protected-mode", "no", *_EPHEMERAL, "--dir", str(folder)])
    with _serving(argv, f"redis://{host.address}:{port}/0", folder / "redis.log") as url:
        yield url


@contextmanager
def _serving(argv: Sequence[str], url: str, log: Path) -> Iterator[str]:
    """Run `argv` until the block ends; yields `url` once the server answers PING."""
    with open(log, "ab") as out:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {log}") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
