"""A real redis-server for the tests, on a Unix socket, stopped by its PID.

A Unix socket in a folder of the test's own needs no port: a TCP port chosen free here could
be taken before redis-server binds it (redis cannot bind port 0 and report it: `--port 0`
turns TCP off). Routers reach it as ``unix://PATH?db=0`` (redis-py's URL form).

`make test` installs Debian's redis-server (the Makefile's `redis` target).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """Start redis-server (no persistence, no TCP, a socket only this user can open); yields
    its URL. Its log goes to `folder`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: `make test` installs it "
                           "(apt-get install redis-server)")
    # A Unix socket's path has at most 107 bytes, and pytest's folders can be longer.
    socket_dir = Path(tempfile.mkdtemp(prefix="turnkv-redis-"))
    socket_path = socket_dir / "redis.sock"
    log = folder / "redis.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(socket_path), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(folder)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    url = f"unix://{socket_path}?db=0"
    try:
        client = redis.Redis.from_url(url)
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
        shutil.rmtree(socket_dir, ignore_errors=True)
