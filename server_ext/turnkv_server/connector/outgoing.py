"""The sending end's transfers: one `Outgoing` per transfer ID, and the table that keeps them.

`sending.Sending` runs the protocol (commands from the step thread, side-channel messages,
writes, replies); what it knows of each transfer lives here, with the checks and arithmetic
that need only that state (no socket, no NIXL call):

- `Registration`: what the receiver registered (its blocks, the range of the request's blocks
  they take, the digest of the tokens they will hold) and when it last said it wants them;
- `Outgoing`: what is known of the request (its tokens, its blocks once it finished), the
  writes posted for it and what they covered layer by layer, and, once it is over here, why
  and the reply owed to the receiver;
- the token check (`Outgoing.token_mismatch`): a registration is honoured only if its digest
  equals the digest of the sender's own tokens over the same range, and only over tokens
  whose KV the sender will hold when it writes (`Outgoing.kv_tokens`);
- the last write: whether it may go (`Outgoing.last_write_problem`), and what the receiver
  still lacks once layer-by-layer writes have covered part of the blocks (`remaining`);
- `Outgoings`: the live transfers, those over here that a late message may still name (it is
  answered at once, with why and whether a write of it may still land, rather than after a
  timeout), and each receiver agent's count of registrations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.identity import token_digest
from turnkv_server.connector.writes import InFlight

CANCELLED = "cancelled by the receiver"


@dataclass
class Registration:
    agent: str
    identity: bytes
    blocks: list[int]
    first_block: int
    tokens: int
    digest: bytes
    unclaimed_until: float
    last_wanted: float
    verified: bool = False

    def fenced(self, now: float) -> bool:
        """Whether the receiver said recently enough that it wants the transfer."""
        return now - self.last_wanted <= sc.FENCE_S


@dataclass
class Outgoing:
    """One transfer ID on the sending side."""

    transfer_id: str
    # The request's token IDs, once known (its prompt while it runs, then all of them).
    token_ids: tuple[int, ...] | None = None
    request_id: str | None = None
    blocks: list[int] | None = None  # set when the request finished normally
    send_deadline: float = math.inf
    reg: Registration | None = None
    writes: InFlight = field(default_factory=InFlight)
    # Layer -> indices (in the request) of blocks whose final content was written.
    streamed: dict[int, set[int]] = field(default_factory=dict)
    streamed_bytes: int = 0
    stream_stopped: bool = False
    final_posted: bool = False
    final_started: float = 0.0
    # Set when the transfer is over here: why, whether the send counts as failed, and the
    # reply owed to the receiver (sent once every write has settled).
    ended: str | None = None
    failed: bool = False
    reply: sc.Failed | sc.Cancelled | None = None

    @property
    def expected(self) -> bool:
        """Its request is alive here (queued, computing, or finished and waiting)."""
        return self.token_ids is not None

    def kv_tokens(self) -> tuple[int, ...]:
        """The tokens whose KV this engine holds, or will hold, when it writes: while the
        request runs, its prompt (a layer is written only for blocks a step completed, and the
        last write waits for the finished request); once it finished, every token but the
        last, which vLLM sampled and never computed KV for."""
        assert self.token_ids is not None
        return self.token_ids if self.blocks is None else self.token_ids[:-1]

    def token_mismatch(self) -> str | None:
        """Check the registration against the request's tokens: marks it verified if they
        match; returns why they cannot, or None (verified, or wait: the prompt is shorter than
        the registration, and the finished request may cover it)."""
        reg = self.reg
        assert reg is not None
        tokens = self.kv_tokens()
        if len(tokens) < reg.tokens:
            if self.blocks is None:
                return None
            return (f"the sender has the KV of {len(tokens)} tokens, the receiver asked for "
                    f"{reg.tokens}")
        if token_digest(tokens[:reg.tokens]) != reg.digest:
            return f"the two engines' first {reg.tokens} tokens differ"
        reg.verified = True
        return None

    def to_stream(self, layer: int, blocks: list[tuple[int, int]], restart: bool, now: float,
                  layers: int) -> list[tuple[int, int]]:
        """Which of `blocks` ((index in the request, block ID)), final in `layer`, to write
        now: those the receiver registered, while the registration is checked and fenced and
        streaming goes on. `restart`: the request was preempted and computes again, so what
        was streamed cannot be trusted, nor anything streamed later (an old write could land
        after a new one): streaming stops, and the last write carries everything."""
        if self.ended is not None or self.final_posted:
            return []
        if restart and not self.stream_stopped and (self.streamed or self.writes):
            self.stream_stopped = True
            self.streamed.clear()
        reg = self.reg
        if reg is None or not reg.verified or self.stream_stopped or self.writes.failed \
                or not reg.fenced(now) or layer >= layers:
            return []
        end = reg.first_block + len(reg.blocks)
        return [(k, block) for k, block in blocks if reg.first_block <= k < end]

    def last_write_source(self) -> list[int]:
        """The finished request's blocks that go into the registered ones."""
        assert self.blocks is not None and self.reg is not None
        return self.blocks[self.reg.first_block:self.reg.first_block + len(self.reg.blocks)]

    def last_write_problem(self, source: list[int], peer_known: bool, now: float
                           ) -> str | None:
        """Why the last write (of `source`) cannot go, or None."""
        reg, blocks = self.reg, self.blocks
        assert reg is not None and blocks is not None
        if self.writes.failed:
            return "a layer-by-layer write failed"
        if len(source) < len(reg.blocks):
            return (f"sender holds {len(blocks)} blocks, asked for blocks "
                    f"{reg.first_block}..{reg.first_block + len(reg.blocks) - 1}")
        if not peer_known:
            return "the receiver's agent is gone"
        if not reg.fenced(now):
            return "the receiver went silent"
        return None

    def remaining(self, source: list[int], table: BlockTable, peer_table: BlockTable
                  ) -> tuple[list[int], list[int]]:
        """Descriptor indices (local, remote) of what the receiver still lacks."""
        reg = self.reg
        assert reg is not None
        if not self.streamed:
            return table.indices(source), peer_table.indices(reg.blocks)
        local: list[int] = []
        remote: list[int] = []
        for layer, ranges in enumerate(table.layer_ranges):
            done = self.streamed.get(layer, set())
            todo = [i for i in range(len(source)) if reg.first_block + i not in done]
            local += table.indices([source[i] for i in todo], ranges)
            remote += peer_table.indices([reg.blocks[i] for i in todo], ranges)
        if not local:
            # Every layer of every block is there; the notification still needs a write.
            return table.indices(source[-1:]), peer_table.indices(reg.blocks[-1:])
        return local, remote

    def deadlines(self) -> list[float]:
        """When the transfer must be looked at again, whatever else happens."""
        if self.reg is not None:
            times = [self.reg.last_wanted + sc.FENCE_S]
            if not self.expected:
                times.append(self.reg.unclaimed_until)
            return times
        return [self.send_deadline] if self.blocks is not None else []


class Outgoings:
    """The sending end's transfers: live ones by transfer ID, and those over here.

    A transfer over here (ended, refused, cancelled or abandoned, possibly before its request or
    registration showed up) is remembered for `memory_s` with why, and whether a write of it
    may still land: a registration that comes later is answered at once, a cancel truthfully,
    and a request that comes later ends at once."""

    def __init__(self, memory_s: float, clock: Callable[[], float]) -> None:
        self._live: dict[str, Outgoing] = {}
        # Transfer ID -> (until when, why, whether a write of it may still land).
        self._over: dict[str, tuple[float, str, bool]] = {}
        self._regs_by_agent: dict[str, int] = {}
        self._memory_s = memory_s
        self._clock = clock

    def get(self, transfer_id: str) -> Outgoing | None:
        return self._live.get(transfer_id)

    def values(self) -> list[Outgoing]:
        """The live transfers (a copy: the caller may end some while it iterates)."""
        return list(self._live.values())

    def open(self, transfer_id: str) -> Outgoing:
        """The live transfer `transfer_id`, created if new (ended at once if it is over)."""
        out = self._live.get(transfer_id)
        if out is None:
            out = self._live[transfer_id] = Outgoing(transfer_id)
            over = self._over.pop(transfer_id, None)
            if over is not None:  # cancelled or refused before its request showed up here
                out.ended, out.failed, out.stream_stopped = over[1], over[1] != CANCELLED, True
                out.writes.may_land = over[2]
        return out

    def over(self, transfer_id: str, reason: str, *, may_land: bool = False,
             replace: bool = True) -> None:
        """Remember that `transfer_id`, not live here, is over (`replace`: even if it was
        already remembered for another reason; a write that may land is never forgotten)."""
        known = self._over.get(transfer_id)
        if known is None or replace:
            may_land = may_land or (known is not None and known[2])
            self._over[transfer_id] = (self._clock() + self._memory_s, reason, may_land)

    def why_over(self, transfer_id: str) -> str | None:
        over = self._over.get(transfer_id)
        return None if over is None else over[1]

    def may_land(self, transfer_id: str) -> bool:
        """Whether a write of `transfer_id`, over here, may still land."""
        over = self._over.get(transfer_id)
        return over is not None and over[2]

    def registrations(self, agent: str) -> int:
        return self._regs_by_agent.get(agent, 0)

    def registered_agents(self) -> set[str]:
        return set(self._regs_by_agent)

    def wanted(self, agent: str, transfer_ids: list[str], now: float) -> list[str]:
        """`agent` says it still wants `transfer_ids` (a ping): their write fences stay open.
        Returns those whose request is alive here and not over (queued, computing, or done
        and waiting to be written)."""
        pending = []
        for transfer_id in transfer_ids:
            out = self._live.get(transfer_id)
            if out is None or out.reg is None or out.reg.agent != agent:
                continue
            out.reg.last_wanted = now
            if out.expected and out.ended is None:
                pending.append(transfer_id)
        return pending

    def register(self, out: Outgoing, reg: Registration) -> None:
        out.reg = reg
        self._regs_by_agent[reg.agent] = self._regs_by_agent.get(reg.agent, 0) + 1

    def unregister(self, reg: Registration) -> None:
        left = self._regs_by_agent.get(reg.agent, 1) - 1
        if left > 0:
            self._regs_by_agent[reg.agent] = left
        else:
            self._regs_by_agent.pop(reg.agent, None)

    def forget(self, out: Outgoing) -> None:
        """`out` is no longer live; if it ended, it is remembered as over."""
        self._live.pop(out.transfer_id, None)
        if out.reg is not None:
            self.unregister(out.reg)
        if out.ended is not None:
            self.over(out.transfer_id, out.ended, may_land=out.writes.may_land)

    def expire(self, now: float) -> None:
        for transfer_id, (until, _, _) in list(self._over.items()):
            if now > until:
                del self._over[transfer_id]

    def busy(self) -> bool:
        """Whether writes are in flight."""
        return any(out.writes for out in self._live.values())

    def next_deadline(self) -> float:
        times = [t for t, _, _ in self._over.values()]
        for out in self._live.values():
            times += out.deadlines()
        return min(times, default=math.inf)

    def clear(self) -> None:
        self._live.clear()
