"""turnkv's KV data path on a CUDA GPU, without vLLM: registration, moves, bytes, rates.

On a GPU vLLM hands the connector one KV tensor per attention layer in GPU memory. This script
makes such caches with torch, registers them through the connector's worker half
(`WorkerSide.register_kv_caches`, the call vLLM makes), and moves blocks between two engines'
caches with turnkv's transfer protocol: the signed side channel, NIXL WRITEs from registered
GPU memory into registered GPU memory (UCX's CUDA transports), the receiver's notification.
It checks and measures:

- bytes: every moved block equals its source bit for bit and no other block changed (fresh
  random data; receivers poisoned with NaN first), for two layouts vLLM uses on GPUs
  (FlashAttention's `[2, blocks, ...]`, K and V apart; FlashInfer's `[blocks, 2, ...]`), with
  both engines in one process and in two processes sharing the GPU;
- rates: from the send and the registration to the receiver's completion, by blocks moved,
  for a model shaped like Qwen3-32B (64 layers, 8 KV heads of 128, bfloat16: 256 KiB of KV
  per token), beside torch copying the same blocks on the device (the ceiling on one GPU).

    python scripts/gpu_check.py --out gpu-check.json            # on a CUDA machine
    python scripts/gpu_check.py --device cpu --quick            # the same, in host memory

Needs torch, NIXL (the wheel for the machine's CUDA), pyzmq and msgspec; nothing of vLLM.
Layer-by-layer writes, gated by CUDA events, are `scripts/gpu_layer_writes.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from turnkv_server.connector.identity import Fingerprint, token_digest
from turnkv_server.connector.worker_side import WorkerSide
from turnkv_server.engine.nixl_poll import apply_poll_delay

SECRET = b"9d2f6a1c4e8b0375a6c1d9e2f4b7083c"
TOKENS_PER_BLOCK = 16
LAYOUTS = ("flash-attn", "flashinfer")


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_size: int
    blocks: int
    dtype: torch.dtype

    def layer_shape(self, layout: str) -> tuple[int, ...]:
        rest = (TOKENS_PER_BLOCK, self.kv_heads, self.head_size)
        return (2, self.blocks, *rest) if layout == "flash-attn" else (self.blocks, 2, *rest)

    @property
    def block_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * 2 * TOKENS_PER_BLOCK * self.kv_heads * self.head_size * element


def synchronize(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


def block_of(layer: torch.Tensor, layout: str, block: int) -> torch.Tensor:
    return layer[:, block] if layout == "flash-attn" else layer[block]


class Engine:
    """One engine's KV cache on `device`, registered as vLLM would register it."""

    def __init__(self, name: str, shape: Shape, layout: str, device: str, listen: bool) -> None:
        self.shape, self.layout = shape, layout
        self.caches = {
            f"model.layers.{i}.self_attn.attn":
                torch.full(shape.layer_shape(layout), float("nan"), dtype=shape.dtype,
                           device=device)
            for i in range(shape.layers)
        }
        # NIXL's copies do not wait for torch's stream: the poison must have landed first.
        synchronize(next(iter(self.caches.values())))
        fingerprint = Fingerprint.of({"model": "gpu-check", "dtype": str(shape.dtype),
                                      "block_size": TOKENS_PER_BLOCK})
        self.worker = WorkerSide(name, ("127.0.0.1", 0) if listen else None, 60.0, 60.0,
                                 secret=SECRET, fingerprint=fingerprint)
        self.worker.register_kv_caches(self.caches, shape.blocks)
        assert self.worker.agent is not None
        self.agent = self.worker.agent
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.failed: set[int] = set()

    @property
    def address(self) -> str:
        assert self.agent.address is not None
        return self.agent.address

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator(device=next(iter(self.caches.values())).device)
        generator.manual_seed(seed)
        for layer in self.caches.values():
            layer.normal_(generator=generator)
        synchronize(layer)

    def blocks_bytes(self, blocks: list[int]) -> list[torch.Tensor]:
        """The blocks' bits (int16 views, so NaN compares equal to itself), on the host."""
        return [torch.stack([block_of(layer, self.layout, b).contiguous().view(torch.int16)
                             for layer in self.caches.values()]).cpu() for b in blocks]

    def collect(self) -> None:
        results = self.agent.take_results()
        self.sent |= results.finished_sending
        self.received |= results.finished_recving
        self.failed |= results.failed_blocks

    def wait(self, done: Callable[[], bool], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.collect()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError("transfer did not complete")
            time.sleep(0.0002)

    def close(self) -> None:
        self.worker.close()


def holds(names: set[str], name: str) -> Callable[[], bool]:
    return lambda: name in names


def prompt_of(blocks: int) -> tuple[int, ...]:
    return tuple(range(1000, 1000 + blocks * TOKENS_PER_BLOCK))


def register(receiver: Engine, sender_address: str, transfer_id: str, blocks: list[int]) -> None:
    prompt = prompt_of(len(blocks))
    receiver.agent.receive(f"rx-{transfer_id}", transfer_id, sender_address, blocks, 0, None,
                           tokens=len(prompt), digest=token_digest(prompt))


def send(sender: Engine, transfer_id: str, blocks: list[int]) -> None:
    # All the request's tokens: its prompt and the one it sampled (whose KV it never computed).
    sender.agent.send(f"tx-{transfer_id}", transfer_id, blocks, (*prompt_of(len(blocks)), 7))


# -- the sender in a process of its own ------------------------------------------------------


def serve_sender(conn: Any, shape: Shape, layout: str, device: str) -> None:
    apply_poll_delay()
    engine = Engine("remote-sender", shape, layout, device, listen=True)
    conn.send(engine.address)
    try:
        while True:
            command, *args = conn.recv()
            if command == "fill":
                engine.fill_random(args[0])
                conn.send("ok")
            elif command == "send":
                transfer_id, blocks = args
                send(engine, transfer_id, blocks)
                engine.wait(holds(engine.sent, f"tx-{transfer_id}"))
                conn.send("sent")
            elif command == "bytes":
                conn.send(engine.blocks_bytes(args[0]))
            else:
                return
    finally:
        engine.close()


class RemoteSender:
    """A sending engine in a process of its own, run by `serve` (`serve_sender`'s commands)."""

    def __init__(self, shape: Shape, layout: str, device: str,
                 serve: Callable[..., None] = serve_sender) -> None:
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, shape, layout, device),
                                       daemon=True)
        self.process.start()
        self.address: str = self.conn.recv()

    def call(self, *message: Any) -> Any:
        self.conn.send(message)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("stop",))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


# -- checks ----------------------------------------------------------------------------------


@contextlib.contextmanager
def engines(shape: Shape, layout: str, device: str, two_processes: bool, seed: int
            ) -> Iterator[tuple[Engine, str, RemoteSender | None, Engine | None]]:
    """A receiver, and a sender holding `seed`'s random KV (in a process of its own if
    `two_processes`, else here): (receiver, sender's address, remote sender, local sender)."""
    receiver = Engine("receiver", shape, layout, device, listen=False)
    remote: RemoteSender | None = None
    local: Engine | None = None
    try:
        if two_processes:
            remote = RemoteSender(shape, layout, device)
            remote.call("fill", seed)
            address = remote.address
        else:
            local = Engine("sender", shape, layout, device, listen=True)
            local.fill_random(seed)
            address = local.address
        yield receiver, address, remote, local
    finally:
        receiver.close()
        if remote is not None:
            remote.close()
        if local is not None:
            local.close()


def check_bytes(shape: Shape, layout: str, device: str, two_processes: bool,
                seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(shape.blocks, generator=generator).tolist()
    count = shape.blocks // 3
    source, target = order[:count], order[count:2 * count]
    with engines(shape, layout, device, two_processes, seed) as (receiver, address, remote,
                                                                  local):
        before = receiver.blocks_bytes(list(range(shape.blocks)))
        transfer_id = f"bytes-{layout}-{int(two_processes)}"
        register(receiver, address, transfer_id, target)
        if remote is not None:
            remote.call("send", transfer_id, source)
        else:
            assert local is not None
            send(local, transfer_id, source)
        receiver.wait(holds(receiver.received, f"rx-{transfer_id}"))
        if device == "cuda":
            torch.cuda.synchronize()
        expected = remote.call("bytes", source) if remote is not None else \
            local.blocks_bytes(source)  # type: ignore[union-attr]
        after = receiver.blocks_bytes(list(range(shape.blocks)))
        moved_equal = all(torch.equal(after[t], e) for t, e in zip(target, expected, strict=True))
        moved = set(target)
        untouched = all(torch.equal(after[b], before[b]) for b in range(shape.blocks)
                        if b not in moved)
        return {"layout": layout, "processes": 2 if two_processes else 1,
                "blocks_moved": count, "failed_blocks": sorted(receiver.failed),
                "moved_equal": moved_equal, "others_untouched": untouched,
                "ok": moved_equal and untouched and not receiver.failed}


def device_copy_ms(engine_from: Engine, engine_to: Engine, source: list[int],
                   target: list[int], repeats: int) -> float:
    """Median time for torch to copy the blocks on the device, layer by layer."""
    src = torch.tensor(source, device=next(iter(engine_from.caches.values())).device)
    dst = torch.tensor(target, device=src.device)
    dim = 1 if engine_from.layout == "flash-attn" else 0
    pairs = list(zip(engine_from.caches.values(), engine_to.caches.values(), strict=True))
    times = []
    for _ in range(repeats + 1):
        if src.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for a, b in pairs:
            b.index_copy_(dim, dst, a.index_select(dim, src))
        if src.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[1:])


def measure_rates(shape: Shape, layout: str, device: str, sizes: list[int], repeats: int,
                  two_processes: bool) -> list[dict[str, Any]]:
    rows = []
    with engines(shape, layout, device, two_processes, 1) as (receiver, address, remote, local):
        for size in sizes:
            times = []
            for attempt in range(repeats + 1):  # the first is a warm-up
                transfer_id = f"rate-{size}-{attempt}"
                source = list(range(size))
                target = list(range(shape.blocks - size, shape.blocks))
                start = time.perf_counter()
                register(receiver, address, transfer_id, target)
                if remote is not None:
                    remote.conn.send(("send", transfer_id, source))
                else:
                    assert local is not None
                    send(local, transfer_id, source)
                receiver.wait(holds(receiver.received, f"rx-{transfer_id}"))
                times.append((time.perf_counter() - start) * 1000)
                if remote is not None:
                    remote.conn.recv()
                else:
                    assert local is not None
                    local.wait(holds(local.sent, f"tx-{transfer_id}"))
            moved = size * shape.block_bytes
            row: dict[str, Any] = {
                "layout": layout, "processes": 2 if two_processes else 1, "blocks": size,
                "tokens": size * TOKENS_PER_BLOCK, "bytes": moved,
                "ms_median": statistics.median(times[1:]),
                "ms_min": min(times[1:]), "ms_max": max(times[1:]),
                "failed_blocks": len(receiver.failed)}
            row["gb_per_s"] = moved / row["ms_median"] / 1e6
            if local is not None:
                copy_ms = device_copy_ms(local, receiver, list(range(size)),
                                         list(range(shape.blocks - size, shape.blocks)),
                                         repeats)
                row["torch_copy_ms"] = copy_ms
                row["torch_copy_gb_per_s"] = moved / copy_ms / 1e6
            rows.append(row)
            print(f"  {layout:10} {row['processes']}p {size:5} blocks "
                  f"{moved / 2**20:8.0f} MiB  {row['ms_median']:8.2f} ms "
                  f"({row['ms_min']:.2f}-{row['ms_max']:.2f})  {row['gb_per_s']:7.2f} GB/s"
                  + (f"  torch {row['torch_copy_ms']:.2f} ms" if "torch_copy_ms" in row else ""),
                  flush=True)
    return rows


def environment(device: str) -> dict[str, Any]:
    import nixl  # noqa: F401  (loads the backend wheel for the machine's CUDA)

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "nixl_backend": sorted(m for m in sys.modules
                                                   if m.startswith("nixl_") and "." not in m),
                            "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true",
                        help="small caches and sizes (a smoke run, for host memory)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", default="1,2",
                        help="engines in one process (1), in two (2), or both (1,2)")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; --device cpu runs the same checks in host memory")
    apply_poll_delay()
    info = environment(args.device)
    print(json.dumps(info), flush=True)
    small = Shape(layers=4, kv_heads=2, head_size=64, blocks=24, dtype=torch.bfloat16)
    if args.quick:
        big, sizes = Shape(4, 2, 64, 64, torch.bfloat16), [1, 16]
    else:
        # Qwen3-32B's KV: 4 MiB per 16-token block; 1,600 blocks hold 25,600 tokens.
        big, sizes = Shape(64, 8, 128, 1600, torch.bfloat16), [1, 16, 64, 256, 1536]
    report: dict[str, Any] = {"environment": info, "bytes": [], "rates": []}
    checks, rates = report["bytes"], report["rates"]

    def save() -> None:  # after every part, so a run cut short still leaves its figures
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    spreads = [count == "2" for count in args.processes.split(",")]
    for layout in LAYOUTS:
        for two in spreads:
            result = check_bytes(small, layout, args.device, two, seed=len(checks) + 7)
            checks.append(result)
            save()
            print(f"bytes {layout:10} {result['processes']}p: "
                  f"{'ok' if result['ok'] else 'FAILED'} {result}", flush=True)
    print(f"rates ({big.block_bytes / 2**20:.0f} MiB per block):", flush=True)
    for layout in LAYOUTS:
        for two in spreads:
            rates += measure_rates(big, layout, args.device, sizes, args.repeats, two)
            save()
    if not all(c["ok"] for c in checks):
        raise SystemExit("bytes check FAILED")
    print("all byte checks passed", flush=True)


if __name__ == "__main__":
    main()
