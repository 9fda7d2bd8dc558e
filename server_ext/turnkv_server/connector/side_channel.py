"""The side channel's messages: typed, signed with the cluster's secret, dropped when stale or
replayed.

Engines exchange control messages over ZeroMQ (a receiver's DEALER to each sender's ROUTER),
encrypted with CURVE keys derived from the cluster's secret (`cluster_secret.ClusterKeys`);
the KV bytes themselves move with NIXL. Every message is a msgspec struct tagged by `op` and
travels as two frames, the msgpack payload and an HMAC-SHA256 of it under the cluster's
secret. Anyone who can reach the port but lacks the secret can neither add a NIXL agent nor
have an engine honour a registration: an unsigned, mis-signed, malformed, stale or replayed
message is dropped (and counted), never answered.

Freshness: each message carries its wall-clock send time (`sent_at`; the two ends share no
monotonic clock) and a random nonce. A message more than `MAX_AGE_S` away from the
receiving end's clock is stale: the window is wide enough for hosts whose clocks differ by a
minute. Within it, a nonce already seen is a replay (`ReplayCache` keeps every accepted nonce
until its message leaves the window). A process keeps its cache for its lifetime only: what
stops a message captured before a restart from being replayed to the new process within the
window is the encryption, under which nothing can be captured. A hello must also be newer
than the last one accepted from its engine to replace that engine's agent
(`sending_peers`).

The flow between a receiver R (lacks blocks) and a sender S (holds them), per transfer T:

    R -> S  Hello        once per S's agent: R's NIXL metadata, block table and fingerprint
    S -> R  HelloOk | HelloRefused (fingerprints or layouts differ)
    R -> S  Register     T: R's blocks, where they start, and a digest of the tokens covered
    R -> S  Ping         every second while R has registrations at S: the T's R still wants
    S -> R  Pong         which of those have a request alive at S (queued, computing, done)
            ... NIXL WRITEs, the last with the notification "turnkv:T" ...
    R -> S  Cancel       R needs nothing more for T (it had every block, or gave up)
    S -> R  Cancelled | Failed   T is over at S: no write of it is in flight or starts, and
                         `writes_may_land` says whether one that NIXL gave up on, or could
                         not release, may still land in R's blocks (then R holds them)
    S -> R  UnknownAgent S does not know R's agent (S restarted): hello again
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import zmq

from turnkv_server.connector.cluster_secret import check_secret

# Messages older or newer than this (wall clock) are dropped.
MAX_AGE_S = 120.0
MAC_BYTES = 32
NONCE_BYTES = 16
# The most nonces one engine remembers: messages accepted within a window of 2 * MAX_AGE_S,
# from every peer together (a sender sees about one ping a second per receiver, and a few
# messages per transfer). Beyond it, messages are dropped rather than a replay let through.
MAX_REMEMBERED = 1 << 18

# The timing of the protocol, in seconds on each engine's own clock (only durations cross).
# A receiver pings each sender it has registrations with this often.
PING_S = 1.0
# A sender starts a write only within this long of the receiver last saying it wants the
# transfer (its registration, or a ping listing it): a receiver that gave up and went quiet
# can count on no write starting later than that.
FENCE_S = 5.0
# What a started write may take to land. A receiver that gave up on a sender that neither
# answers nor has vanished reuses the transfer's blocks only this long after the fence.
WRITE_GRACE_S = 10.0


class Message(msgspec.Struct, tag_field="op", kw_only=True):
    agent: str  # the NIXL agent name of the engine that sent the message
    sent_at: float = 0.0
    nonce: bytes = b""  # random, set by `Codec.encode`: the same message twice is a replay


class Hello(Message, tag="hello"):
    engine_id: str
    meta: bytes
    table: dict[str, Any]
    fingerprint: dict[str, str]


class HelloOk(Message, tag="hello_ok"):
    pass


class HelloRefused(Message, tag="hello_refused"):
    reason: str


class Register(Message, tag="register"):
    transfer_id: str
    blocks: list[int]
    first_block: int
    tokens: int
    digest: bytes
    timeout_s: float


class Ping(Message, tag="ping"):
    live: list[str]


class Pong(Message, tag="pong"):
    pending: list[str]


class Cancel(Message, tag="cancel"):
    transfer_id: str


class Cancelled(Message, tag="cancelled"):
    transfer_id: str
    # Whether a write of the transfer may still land in the receiver's blocks: NIXL reported
    # one failed, or would not release it. Absent (an older sender) reads as "may".
    writes_may_land: bool = True


class Failed(Message, tag="failed"):
    transfer_id: str
    reason: str
    writes_may_land: bool = True


class UnknownAgent(Message, tag="unknown_agent"):
    transfer_id: str


AnyMessage = (Hello | HelloOk | HelloRefused | Register | Ping | Pong | Cancel | Cancelled
              | Failed | UnknownAgent)


class Rejected(ValueError):
    """A message that is not ours to act on: unsigned, mis-signed, malformed, stale or
    replayed."""


class ReplayCache:
    """The nonces of the messages accepted while they could still be replayed, each until
    its message leaves the freshness window."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._limit = limit
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []  # a heap: (when it may go, nonce)

    def admit(self, nonce: bytes, sent_at: float, now: float) -> None:
        """Remember `nonce`, or raise `Rejected` if it was seen."""
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if nonce in self._seen:
            raise Rejected("replayed")
        if len(self._seen) >= self._limit:
            raise Rejected("too many messages within the freshness window")
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (sent_at + MAX_AGE_S, nonce))

    def __len__(self) -> int:
        return len(self._seen)


class Codec:
    """Signs and checks messages under one cluster's secret; refuses stale and replayed ones.
    Not thread-safe: one transfer thread uses it."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        check_secret(secret)
        self._secret = secret
        self._clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyMessage)
        self._seen = ReplayCache()

    def encode(self, message: Message) -> list[bytes]:
        """The frames to send: payload and its MAC."""
        message.sent_at = self._clock()
        message.nonce = os.urandom(NONCE_BYTES)
        payload = self._encoder.encode(message)
        return [payload, self._mac(payload)]

    def decode(self, frames: Sequence[bytes]) -> AnyMessage:
        """The message in `frames` (payload, MAC), or `Rejected`."""
        if len(frames) != 2:
            raise Rejected(f"{len(frames)} frames, expected 2")
        payload, mac = frames
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(payload)):
            raise Rejected("bad signature")
        try:
            message = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise Rejected(f"malformed: {exc}") from exc
        now = self._clock()
        if abs(now - message.sent_at) > MAX_AGE_S:
            raise Rejected("stale")
        if len(message.nonce) != NONCE_BYTES:
            raise Rejected("no nonce")
        self._seen.admit(message.nonce, message.sent_at, now)
        return message

    def receive_all(self, socket: zmq.Socket[Any], routed: bool,
                    rejected: Callable[[Rejected], None]) -> Iterator[tuple[bytes, AnyMessage]]:
        """Every message waiting on `socket`, decoded, with the identity of the peer that sent
        it (`routed`: a ROUTER's; otherwise empty); each one dropped goes to `rejected`."""
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = b""
            if routed:
                if len(frames) < 2:
                    continue
                identity, frames = frames[0], frames[1:]
            try:
                message = self.decode(frames)
            except Rejected as exc:
                rejected(exc)
                continue
            yield identity, message

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()
