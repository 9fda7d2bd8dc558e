"""The receiver agents the sending end writes into: admitted on hello, forgotten when unsafe.

A receiver says hello before it registers anything; `SendingPeers.admit` loads its NIXL
metadata into the `Writer` only if its engine matches this one (model fingerprint and KV block
layout: KV is copied by position, so anything else would write garbage). A restarted engine
says hello under a new agent name: its old agent is dropped first (the caller ends the
transfers registered by it), but only for a hello sent after the last one admitted from that
engine: an older hello of another agent (a previous process's, held back and delivered late)
is dropped as stale rather than allowed to replace the agent that serves the engine now. At
most `MAX_PEERS` agents are known at once; a new one takes the place of the idle agent heard
from least recently.

An agent a write failed to is doomed: it is forgotten once its writes have settled, and if it
lives, its next registration is answered `UnknownAgent` and it says hello again.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.writes import Peer, Writer

# How many receiver agents are known at once.
MAX_PEERS = 256
# How many engines' newest admitted hellos are remembered.
MAX_ENGINES_REMEMBERED = 4 * MAX_PEERS


class SendingPeers:
    def __init__(self, writer: Writer, fingerprint: Fingerprint,
                 clock: Callable[[], float]) -> None:
        self._writer = writer
        self._fingerprint = fingerprint
        self._clock = clock
        self._seen: dict[str, float] = {}
        # Agents a write failed to: forgotten once their writes have settled.
        self._doomed: set[str] = set()
        # Engine ID -> (agent, sent_at) of the newest hello admitted from it.
        self._newest: dict[str, tuple[str, float]] = {}

    def heard(self, agent: str, now: float) -> None:
        """A message came from `agent` (kept for the least-recently-heard eviction)."""
        if agent in self._writer.peers:
            self._seen[agent] = now

    def admit(self, msg: sc.Hello, drop: Callable[[str], None],
              busy: Callable[[], set[str]]) -> str | None:
        """Admit the agent saying hello; returns why it is refused, or None. `drop` ends an
        older agent of the same engine; `busy`: the agents that hold registrations here.
        Raises `side_channel.Rejected` for a hello older than its engine's current agent's."""
        newest = self._newest.get(msg.engine_id)
        if newest is not None and newest[0] != msg.agent and msg.sent_at < newest[1]:
            raise sc.Rejected(f"a hello of engine {msg.engine_id} older than its agent's")
        writer = self._writer
        differences = self._fingerprint.differences(Fingerprint.from_wire(msg.fingerprint))
        table = None
        try:
            table = BlockTable.from_wire(msg.table)
        except (KeyError, TypeError, ValueError):
            differences.append("block table unreadable")
        if table is not None and not table.compatible(writer.table):
            differences.append("KV block layouts differ")
        if differences:
            return "; ".join(differences)
        assert table is not None
        if msg.agent not in writer.peers:
            # A restarted engine says hello under a new agent name: the old one is gone.
            for old in [p for p in writer.peers.values() if p.engine_id == msg.engine_id]:
                drop(old.name)
            if len(writer.peers) >= MAX_PEERS and not self._evict_idle(busy()):
                return "too many peers"
            try:
                writer.add_peer(msg.agent, msg.engine_id, msg.meta, table)
            except Exception as exc:
                return f"NIXL refused: {exc}"
        self._seen[msg.agent] = self._clock()
        self._newest[msg.engine_id] = (msg.agent, max(msg.sent_at, newest[1] if newest else 0))
        if len(self._newest) > MAX_ENGINES_REMEMBERED:
            del self._newest[min(self._newest, key=lambda e: self._newest[e][1])]
        return None

    def doom(self, peer: Peer | None) -> None:
        """A write to `peer` failed: forget it once its writes settle."""
        if peer is not None:
            self._doomed.add(peer.name)

    def settle(self) -> None:
        """Forget the doomed agents that have no write in flight any more."""
        for name in list(self._doomed):
            peer = self._writer.peers.get(name)
            if peer is None or peer.in_flight == 0:
                self._doomed.discard(name)
                self._writer.remove_peer(name)

    def _evict_idle(self, busy: set[str]) -> bool:
        idle = [p for p in self._writer.peers.values()
                if p.in_flight == 0 and p.name not in busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda p: self._seen.get(p.name, -math.inf))
        self._writer.remove_peer(oldest.name)
        return True
