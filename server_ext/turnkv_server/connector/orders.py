"""What the connector's scheduler half tells its worker half, once per scheduler step.

`scheduler_side.SchedulerSide.build_orders` collects a step's `StepOrders`; vLLM carries them
to the model runner as the step's connector metadata, and `worker_side.WorkerSide.apply`
hands them to the transfer thread. Plain data, in a module of its own: the worker half
imports it without the scheduler half's logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ReceiveOrder:
    """Register `blocks` (the request's blocks from index `first_block` on) with `peer` under
    `transfer_id`. Once written they hold the KV of the request's first `tokens` tokens, whose
    `token_digest` is `digest`."""

    request_id: str
    transfer_id: str
    peer: str
    blocks: list[int]
    first_block: int
    timeout_s: float | None
    tokens: int
    digest: bytes


@dataclass(frozen=True)
class ExpectOrder:
    """A request that will send under `transfer_id` has arrived (queued or computing): its
    prompt's token IDs, to check registrations that come before it ends."""

    transfer_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SendOrder:
    """The request finished normally: write `blocks` to whoever registers `transfer_id`.
    `token_ids`: all its tokens (prompt and output)."""

    request_id: str
    transfer_id: str
    blocks: list[int]
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StreamOrder:
    """This step completes `blocks` ((index in the request, block ID) pairs) of a request whose
    KV goes to `transfer_id`'s receiver. `restart`: the request was preempted and recomputes."""

    transfer_id: str
    blocks: list[tuple[int, int]]
    restart: bool = False


class LayerReady(Protocol):
    """Completes once a streamed layer's KV is in memory: on a GPU, a CUDA event recorded
    after the layer's kernels (the worker half's `layer_computed`)."""

    def synchronize(self) -> None: ...


@dataclass
class StepOrders:
    expects: list[ExpectOrder] = field(default_factory=list)
    receives: list[ReceiveOrder] = field(default_factory=list)
    sends: list[SendOrder] = field(default_factory=list)
    declines: list[tuple[str, str]] = field(default_factory=list)  # (transfer_id, peer)
    # Transfers this engine was to send but has no (complete) KV for.
    refusals: list[str] = field(default_factory=list)
    # Sends to give up if nobody has registered for them yet: their blocks are needed here,
    # or the router knows nobody will.
    abandons: list[str] = field(default_factory=list)
    # Receives whose request was aborted while its KV was arriving.
    cancels: list[str] = field(default_factory=list)
    streams: list[StreamOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.expects or self.receives or self.sends or self.declines
                    or self.refusals or self.abandons or self.cancels or self.streams)
