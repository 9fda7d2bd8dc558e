"""Layer-by-layer KV writes on a CUDA GPU: gated by CUDA events, and what they save.

A sending engine (a process of its own, as deployed) plays a prefill: per layer, a kernel that
stands for the layer's compute (`torch.cuda._sleep`) and then one that writes the layer's KV
into the request's blocks, after which it tells the connector's worker half the layer is done
(`WorkerSide.layer_computed`, as vLLM's `save_kv_layer` does). The worker half records a CUDA
event there and the transfer thread writes the layer to the registered receiver once the event
has completed; the rest goes with the last write when the request ends. Three ways, each
checked against the sender's final bytes (a checksum per block and layer):

- `events`: the connector as built;
- `no-events`: the same layer writes without the event (what the connector did before it
  had one, had it streamed on a GPU): NIXL may read a layer before its kernel wrote it, and the
  receiver gets stale KV, the hazard the events close;
- `at-end`: nothing streamed, one write when the request ends.

For each: time from the prefill's first kernel to the receiver's completion, and from the
prefill's end (its last kernel completed) to that completion: what the turn waits for its KV
beyond the compute.

    python scripts/gpu_layer_writes.py --out gpu-layer-writes.json          # a CUDA machine
    python scripts/gpu_layer_writes.py --device cpu --quick                 # host memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from gpu_check import (
    Engine,
    RemoteSender,
    Shape,
    apply_poll_delay,
    environment,
    holds,
    prompt_of,
    register,
    send,
    synchronize,
)

from turnkv_server.connector.orders import StepOrders, StreamOrder

MODES = ("events", "no-events", "at-end")


def checksums(engine: Engine, blocks: list[int]) -> torch.Tensor:
    """Per block and layer, the sum of its bits (int16 words): equal KV, equal sums."""
    dim = 1 if engine.layout == "flash-attn" else 0
    index = torch.tensor(blocks, device=next(iter(engine.caches.values())).device)
    sums = [layer.index_select(dim, index).view(torch.int16).to(torch.int64)
            .movedim(dim, 0).flatten(1).sum(1) for layer in engine.caches.values()]
    return torch.stack(sums, 1).cpu()


def cycles_per_ms(device: str) -> float:
    if device != "cuda":
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def prefill(engine: Engine, cycles: float, transfer_id: str, blocks: list[int],
            layer_ms: float, mode: str, value: float) -> dict[str, float]:
    """The prefill of a request holding `blocks`, sending under `transfer_id`."""
    engine.agent.expect(transfer_id, prompt_of(len(blocks)))
    deadline = time.monotonic() + 30
    while getattr(engine.agent.sending.transfers.get(transfer_id), "reg", None) is None:
        assert time.monotonic() < deadline, "the receiver never registered"
        time.sleep(0.001)
    stream = StreamOrder(transfer_id, list(enumerate(blocks)))
    engine.worker.apply(StepOrders(streams=[stream] if mode != "at-end" else []))
    dim = 1 if engine.layout == "flash-attn" else 0
    first = next(iter(engine.caches.values()))
    index = torch.tensor(blocks, device=first.device)
    synchronize(first)
    start = time.perf_counter()
    for i, (name, layer) in enumerate(engine.caches.items()):
        if cycles:
            torch.cuda._sleep(int(layer_ms * cycles))  # the layer's compute
        else:
            time.sleep(layer_ms / 1000)
        layer.index_fill_(dim, index, value + (i % 16))  # its KV
        if mode == "events":
            engine.worker.layer_computed(name)
        elif mode == "no-events":
            engine.agent.write_layer(transfer_id, i, stream.blocks)
    synchronize(first)
    computed = time.perf_counter()
    send(engine, transfer_id, blocks)
    engine.wait(holds(engine.sent, f"tx-{transfer_id}"))
    return {"start": start, "computed": computed}


def serve_streaming_sender(conn: Any, shape: Shape, layout: str, device: str) -> None:
    apply_poll_delay()
    engine = Engine("streaming-sender", shape, layout, device, listen=True)
    engine.fill_random(11)
    cycles = cycles_per_ms(device)
    conn.send(engine.address)
    try:
        while True:
            command, *args = conn.recv()
            if command == "prefill":
                conn.send(prefill(engine, cycles, *args))
            elif command == "checksums":
                conn.send(checksums(engine, args[0]))
            else:
                return
    finally:
        engine.close()


def run(shape: Shape, layout: str, device: str, moved: int, layer_ms: float,
        repeats: int) -> list[dict[str, Any]]:
    receiver = Engine("receiver", shape, layout, device, listen=False)
    remote = RemoteSender(shape, layout, device, serve=serve_streaming_sender)
    source = list(range(moved))
    target = list(range(shape.blocks - moved, shape.blocks))
    rows = []
    try:
        for mode in MODES:
            totals, beyond, exact = [], [], []
            for attempt in range(repeats + 1):  # the first is a warm-up
                transfer_id = f"{mode}-{layer_ms}-{attempt}"
                register(receiver, remote.address, transfer_id, target)
                value = 0.25 * (attempt + 1) + (4 if mode == "no-events" else 0)
                remote.conn.send(("prefill", transfer_id, source, layer_ms, mode, value))
                receiver.wait(holds(receiver.received, f"rx-{transfer_id}"))
                received = time.perf_counter()
                times = remote.conn.recv()
                synchronize(next(iter(receiver.caches.values())))
                exact.append(torch.equal(checksums(receiver, target),
                                         remote.call("checksums", source)))
                if attempt:
                    totals.append((received - times["start"]) * 1000)
                    beyond.append((received - times["computed"]) * 1000)
            row = {"layout": layout, "mode": mode, "blocks": moved,
                   "bytes": moved * shape.block_bytes, "layer_ms": layer_ms,
                   "layers": shape.layers, "exact": all(exact), "exact_runs": sum(exact),
                   "runs": len(exact), "failed_blocks": len(receiver.failed),
                   "total_ms": statistics.median(totals), "total_ms_range": [min(totals),
                                                                             max(totals)],
                   "beyond_compute_ms": statistics.median(beyond),
                   "beyond_compute_ms_range": [min(beyond), max(beyond)]}
            rows.append(row)
            print(f"  {layout:10} {mode:9} {moved} blocks, {layer_ms} ms/layer: "
                  f"exact {row['exact_runs']}/{row['runs']}, total {row['total_ms']:.1f} ms, "
                  f"beyond compute {row['beyond_compute_ms']:.1f} ms "
                  f"({min(beyond):.1f}-{max(beyond):.1f})", flush=True)
    finally:
        receiver.close()
        remote.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="a small cache (host memory)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; --device cpu runs the same in host memory")
    apply_poll_delay()
    report: dict[str, Any] = {"environment": environment(args.device), "rows": []}
    print(json.dumps(report["environment"]), flush=True)
    if args.quick:
        shape, moved, per_layer = Shape(4, 2, 64, 24, torch.bfloat16), 8, [1.0]
    else:
        # Qwen3-32B's KV (4 MiB a 16-token block); 24,576 tokens moved.
        shape, moved, per_layer = Shape(64, 8, 128, 1600, torch.bfloat16), 1536, [0.5, 5.0]
    for layout in ("flashinfer", "flash-attn"):
        for layer_ms in per_layer:
            report["rows"] += run(shape, layout, args.device, moved, layer_ms, args.repeats)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    if not all(r["exact"] for r in report["rows"] if r["mode"] != "no-events"):
        raise SystemExit("layer writes FAILED: a receiver's KV differs from its sender's")
    print("the connector's writes (events, at-end) were exact", flush=True)


if __name__ == "__main__":
    main()
