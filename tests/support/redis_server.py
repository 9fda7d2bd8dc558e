"""A real redis-server for the tests, on a free port, stopped by its PID.

`make test` installs Debian's redis-server (the Makefile's `redis` target).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from turnkv_server.launcher.processes import free_ports


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """Start redis-server (no persistence, loopback only); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: `make test` installs it "
                           "(apt-get install redis-server)")
    port = free_ports(1)[0]
    log = folder / "redis.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(folder)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
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
