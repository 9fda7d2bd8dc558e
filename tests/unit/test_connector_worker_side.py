"""The worker half hands each order to the transfer agent, and reports its side-channel address."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.orders import (
    ExpectOrder,
    ReceiveOrder,
    SendOrder,
    StepOrders,
)
from turnkv_server.connector.worker_side import WorkerSide
from turnkv_server.ports import read_report


class Agent:
    """Records what the worker asked of the transfer thread."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, args, kwargs))
        return record


def test_every_order_reaches_the_agent() -> None:
    worker = WorkerSide("e", None, 120.0, 60.0, secret=b"s" * 32,
                        fingerprint=Fingerprint.of({}))
    agent = Agent()
    worker.agent = agent
    worker.apply(StepOrders(
        expects=[ExpectOrder("t0", (1, 2, 3))],
        receives=[ReceiveOrder("r1", "t1", "h:1", [4, 5], 2, 9.0, 40, b"d" * 16)],
        sends=[SendOrder("r2", "t2", [6], (1, 2))],
        declines=[("t3", "h:1")], refusals=["t4"], abandons=["t5"], cancels=["t6"]))
    assert agent.calls == [
        ("expect", ("t0", (1, 2, 3)), {}),
        ("receive", ("r1", "t1", "h:1", [4, 5], 2, 9.0), {"tokens": 40, "digest": b"d" * 16}),
        ("send", ("r2", "t2", [6], (1, 2)), {}),
        ("decline", ("t3", "h:1"), {}),
        ("refuse", ("t4",), {}),
        ("abandon", ("t5",), {}),
        ("cancel_receive", ("t6",), {}),
    ]


def test_the_bound_address_is_reported_atomically(tmp_path: Path) -> None:
    report = tmp_path / "side-channel.addr"
    worker = WorkerSide("e", ("127.0.0.1", 0), 120.0, 60.0, secret=b"s" * 32,
                        fingerprint=Fingerprint.of({}), report_path=str(report))
    # Port 0: the agent bound a free port; the launcher reads which from the report.
    worker.agent = Agent("127.0.0.1:40123")
    worker.report_address()
    assert read_report(report) == ("127.0.0.1", 40123)
    worker.agent = Agent("127.0.0.1:40124")  # a new agent
    worker.report_address()
    assert read_report(report) == ("127.0.0.1", 40124)
    assert os.listdir(tmp_path) == ["side-channel.addr"]  # no temporary file left behind
    # No report asked for: nothing written.
    quiet = WorkerSide("e", None, 120.0, 60.0, secret=b"s" * 32, fingerprint=Fingerprint.of({}))
    quiet.agent = Agent(None)
    quiet.report_address()


def test_the_fingerprint_offered_to_peers_describes_the_kv_tensors() -> None:
    blocks = 8
    fingerprints = []
    # Same model, same byte ranges per block; heads and tokens in another order.
    for layer in (torch.zeros(2, blocks, 16, 4, 32), torch.zeros(2, blocks, 4, 16, 32)):
        worker = WorkerSide("e", None, 120.0, 60.0, secret=b"s" * 32,
                            fingerprint=Fingerprint.of({"model": "m"}))
        worker.register_kv_caches({"layers.0": layer, "layers.1": layer.clone()}, blocks)
        try:
            assert worker.agent is not None
            fingerprints.append(worker.agent.fingerprint)
        finally:
            worker.close()
    nhd, hnd = fingerprints
    assert dict(nhd.fields)["kv_tensors"] == "2x float32[2,B,16,4,32] order 0,1,2,3,4"
    assert [d.split(":")[0] for d in nhd.differences(hnd)] == ["kv_tensors"]
