"""NIXL writes from this engine's KV cache into peers' caches, and nothing else.

`Writer` owns the NIXL agent's view of memory: this engine's registered cache, and each peer
agent's cache described from its block table. It posts WRITEs and reports their states; every
NIXL call it makes is failure-safe (a peer that died mid-write makes NIXL raise, and that must
fail the one transfer, never the thread that serves every transfer).

`InFlight` tracks one transfer's posted writes. NIXL completes writes to one peer roughly in the
order they were posted, so it checks them oldest first and stops at the first still running:
each handle is looked at about once after it completes, which keeps a prefill that writes every
layer of every step linear in layers rather than quadratic.

What the sender can truthfully say of a write once NIXL stops reporting it in progress: "DONE"
and released, it is over; failed ("ERR", or NIXL raised), NIXL gave it up, but over UCX on TCP
its bytes may still be on the way (`InFlight.may_land`); and a handle NIXL refuses to release
("could not cancel an active transfer") is a write NIXL itself still counts active. Such a
handle is kept (`Writer.unreleased`), its peer's agent with it, and released again every
`RELEASE_RETRY_S` until NIXL lets it go.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv_server.connector.blocktable import BlockTable

log = logging.getLogger(__name__)

# How often a write handle NIXL would not release is offered back to it.
RELEASE_RETRY_S = 1.0


class WriteError(RuntimeError):
    """A write could not be posted (stale metadata, a dead peer, a refused descriptor).
    `may_land`: NIXL had started it, so some of it may land all the same."""

    def __init__(self, message: str, may_land: bool) -> None:
        super().__init__(message)
        self.may_land = may_land


@dataclass
class Peer:
    """A remote agent this engine may write into."""

    name: str
    engine_id: str
    table: BlockTable
    dlist: Any
    # Writes posted to it and not yet settled: it is removed only when none are left.
    in_flight: int = 0


class Writer:
    def __init__(self, nixl: Any, table: BlockTable,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nixl = nixl
        self.table = table
        self._clock = clock
        self._registered: Any = None
        self._local: Any = None
        self.peers: dict[str, Peer] = {}
        # Handles NIXL would not release (it counts their writes active), with their peers.
        self._unreleased: list[tuple[Any, Peer]] = []
        self._retry_at = math.inf

    def register_memory(self, buffers: list[tuple[int, int]]) -> None:
        """Register the cache's buffers (address, length) and prepare the local descriptors."""
        reg = self.nixl.get_reg_descs(
            [(address, length, self.table.device, "") for address, length in buffers],
            self.table.mem_type)
        self.nixl.register_memory(reg)
        self._registered = reg
        descs = self.nixl.get_xfer_descs(self.table.descriptors(), self.table.mem_type)
        self._local = self.nixl.prep_xfer_dlist("NIXL_INIT_AGENT", descs)

    def add_peer(self, name: str, engine_id: str, meta: bytes, table: BlockTable) -> Peer:
        """Load a peer agent's metadata (`name` is the agent name inside `meta`)."""
        self.nixl.add_remote_agent(meta)
        try:
            descs = self.nixl.get_xfer_descs(table.descriptors(), table.mem_type)
            dlist = self.nixl.prep_xfer_dlist(name, descs)
        except Exception:
            with contextlib.suppress(Exception):
                self.nixl.remove_remote_agent(name)
            raise
        peer = self.peers[name] = Peer(name, engine_id, table, dlist)
        return peer

    def remove_peer(self, name: str) -> None:
        """Forget a peer agent (it left, or restarted under a new name)."""
        peer = self.peers.pop(name, None)
        if peer is None:
            return
        for call in (lambda: self.nixl.release_dlist_handle(peer.dlist),
                     lambda: self.nixl.remove_remote_agent(name)):
            try:
                call()
            except Exception as exc:  # a peer that is gone may make NIXL complain; it is gone
                log.debug("turnkv: removing agent %s: %s", name, exc)

    def post(self, peer: Peer, local_blocks: Sequence[int], remote_blocks: Sequence[int],
             ranges: Sequence[int] | None = None, notif: bytes = b"") -> Any:
        """WRITE `local_blocks` into the peer's `remote_blocks` (only `ranges` of each block,
        if given); returns the handle, already posted. Raises `WriteError`."""
        return self.post_indices(peer, self.table.indices(local_blocks, ranges),
                                 peer.table.indices(remote_blocks, ranges), notif)

    def post_indices(self, peer: Peer, local: list[int], remote: list[int],
                     notif: bytes = b"") -> Any:
        try:
            handle = self.nixl.make_prepped_xfer("WRITE", self._local, local, peer.dlist,
                                                 remote, notif)
        except Exception as exc:
            raise WriteError(f"NIXL refused the write: {exc}", may_land=False) from exc
        try:
            state = self.nixl.transfer(handle)
        except Exception as exc:
            self.release_or_keep(handle, peer)
            raise WriteError(f"NIXL write failed: {exc}", may_land=True) from exc
        if state == "ERR":
            # Some of its descriptors may have been posted before one failed.
            self.release_or_keep(handle, peer)
            raise WriteError("NIXL write failed", may_land=True)
        return handle

    def state(self, handle: Any) -> str:
        """"PROC", "DONE" or "ERR"; a NIXL error (a peer gone mid-write) reads as "ERR"."""
        try:
            return str(self.nixl.check_xfer_state(handle))
        except Exception as exc:
            log.warning("turnkv: a write's state could not be read (%s); taken as failed", exc)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Give the handle back to NIXL; False if NIXL refused (its write is still active)."""
        try:
            self.nixl.release_xfer_handle(handle)
        except Exception as exc:
            log.warning("turnkv: NIXL would not release a write handle (%s); kept, and "
                        "offered back every %g s", exc, RELEASE_RETRY_S)
            return False
        return True

    def release_or_keep(self, handle: Any, peer: Peer) -> bool:
        """Release a handle whose write counts against `peer`; one NIXL refuses is kept,
        counting still, until `retry_releases` gets rid of it. Returns whether released."""
        if self.release(handle):
            return True
        peer.in_flight += 1
        self._unreleased.append((handle, peer))
        self._retry_at = min(self._retry_at, self._clock() + RELEASE_RETRY_S)
        return False

    def retry_releases(self, now: float) -> None:
        if now < self._retry_at:
            return
        kept = []
        for handle, peer in self._unreleased:
            try:
                self.nixl.release_xfer_handle(handle)
            except Exception:
                kept.append((handle, peer))
            else:
                peer.in_flight -= 1
        self._unreleased = kept
        self._retry_at = now + RELEASE_RETRY_S if kept else math.inf

    def unreleased(self) -> int:
        """How many write handles NIXL has not let go of."""
        return len(self._unreleased)

    def next_retry(self) -> float:
        return self._retry_at

    def close(self) -> None:
        for handle, _ in self._unreleased:
            with contextlib.suppress(Exception):  # NIXL frees what is left at exit
                self.nixl.release_xfer_handle(handle)
        self._unreleased.clear()
        for name in list(self.peers):
            self.remove_peer(name)
        with contextlib.suppress(Exception):
            if self._local is not None:
                self.nixl.release_dlist_handle(self._local)
            if self._registered is not None:
                self.nixl.deregister_memory(self._registered)
        self._local = self._registered = None


@dataclass
class InFlight:
    """One transfer's posted writes, oldest first, until NIXL is done with them."""

    handles: deque[tuple[Any, Peer]] = field(default_factory=deque)
    # A write did not complete; and whether any may land all the same (module docstring).
    failed: bool = False
    may_land: bool = False

    def add(self, handle: Any, peer: Peer) -> None:
        self.handles.append((handle, peer))
        peer.in_flight += 1

    def settle(self, writer: Writer) -> bool:
        """Release what has completed; True when NIXL reports nothing in progress."""
        while self.handles:
            handle, peer = self.handles[0]
            state = writer.state(handle)
            if state == "PROC":
                return False
            self.handles.popleft()
            peer.in_flight -= 1
            if state != "DONE":
                self.failed = self.may_land = True
            if not writer.release_or_keep(handle, peer):
                self.may_land = True
        return True

    def abandon(self, writer: Writer) -> None:
        """Stop following these writes (their transfer ended in error): the writer releases
        them when NIXL lets go. They may land."""
        while self.handles:
            handle, peer = self.handles.popleft()
            peer.in_flight -= 1
            writer.release_or_keep(handle, peer)
            self.failed = self.may_land = True

    def __bool__(self) -> bool:
        return bool(self.handles)
