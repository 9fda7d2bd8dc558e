"""The side channel's messages: typed, signed with the cluster's secret, dropped when stale.

Engines exchange control messages over ZeroMQ (a receiver's DEALER to each sender's ROUTER);
the KV bytes themselves move with NIXL. Every message is a msgspec struct tagged by `op` and
travels as two frames, the msgpack payload and an HMAC-SHA256 of it under the per-cluster
secret. Anyone who can reach the port but lacks the secret can neither add a NIXL agent nor
have an engine honour a registration: an unsigned, mis-signed, malformed or stale message is
dropped (and counted), never answered.

Staleness uses wall-clock time (`sent_at`), since the two ends share no monotonic clock; the
window is wide enough for hosts whose clocks differ by a minute and still stops a replay of
yesterday's hello.

The flow between a receiver R (lacks blocks) and a sender S (holds them), per transfer T:

    R -> S  Hello        once per S's agent: R's NIXL metadata, block table and fingerprint
    S -> R  HelloOk | HelloRefused (fingerprints or layouts differ)
    R -> S  Register     T: R's blocks, where they start, and a digest of the tokens covered
    R -> S  Ping         every second while R has registrations at S: the T's R still wants
    S -> R  Pong         which of those have a request alive at S (queued, computing, done)
            ... NIXL WRITEs, the last with the notification "turnkv:T" ...
    R -> S  Cancel       R needs nothing more for T (it had every block, or gave up)
    S -> R  Cancelled | Failed   T is over at S: every write of it has settled, none starts
    S -> R  UnknownAgent S does not know R's agent (S restarted): hello again
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

# Messages older or newer than this (wall clock) are dropped.
MAX_AGE_S = 120.0
MAC_BYTES = 32

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


class Failed(Message, tag="failed"):
    transfer_id: str
    reason: str


class UnknownAgent(Message, tag="unknown_agent"):
    transfer_id: str


AnyMessage = (Hello | HelloOk | HelloRefused | Register | Ping | Pong | Cancel | Cancelled
              | Failed | UnknownAgent)


class Rejected(ValueError):
    """A message that is not ours to act on: unsigned, mis-signed, malformed or stale."""


class Codec:
    """Signs and checks messages under one cluster's secret."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        if not secret:
            raise ValueError("the side channel needs a non-empty secret")
        self._secret = secret
        self._clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyMessage)

    def encode(self, message: Message) -> list[bytes]:
        """The frames to send: payload and its MAC."""
        message.sent_at = self._clock()
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
        if abs(self._clock() - message.sent_at) > MAX_AGE_S:
            raise Rejected("stale")
        return message

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()
