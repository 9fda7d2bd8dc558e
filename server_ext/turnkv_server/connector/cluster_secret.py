"""The cluster's side-channel secret: which secrets are accepted, and the keys made from one.

Every engine of a cluster holds the same secret (`TURNKV_SIDE_CHANNEL_SECRET`). It signs each
side-channel message (`side_channel.Codec`), and it gives the side channel's ZeroMQ CURVE keys
(`ClusterKeys`), so encryption needs no configuration of its own. A secret anyone could guess
would give all of that away, so `check_secret` refuses one shorter than `MIN_SECRET_BYTES`
(16 random bytes written in hex: `openssl rand -hex 32` gives 64 characters) and the
placeholders of the project's own examples.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import zmq
from zmq.utils import z85

MIN_SECRET_BYTES = 32
# Marks of a value that was meant to be replaced (deploy/kubernetes/base/secrets.yaml has
# "REPLACE-ME-..."); compared without case.
PLACEHOLDERS = ("replace-me", "replace_me", "replaceme", "change-me", "change_me", "changeme",
                "placeholder")
HOW_TO_MAKE_ONE = "make one with `openssl rand -hex 32`, the same on every engine"


def check_secret(secret: bytes) -> None:
    """Raise `ValueError` if `secret` is too short or a placeholder. Never says the secret."""
    lowered = secret.lower()
    for marker in PLACEHOLDERS:
        if marker.encode() in lowered:
            raise ValueError(f"turnkv: the side channel's secret is a placeholder (it contains "
                             f"{marker!r}): {HOW_TO_MAKE_ONE}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"turnkv: the side channel's secret has {len(secret)} bytes, fewer "
                         f"than {MIN_SECRET_BYTES}: {HOW_TO_MAKE_ONE}")


class ClusterKeys:
    """ZeroMQ CURVE keys of one cluster's side channels.

    Every engine's side channel serves under one keypair derived from the secret; a receiver
    connects with a fresh keypair of its own and the server's public key, which it derives
    too. Whoever lacks the secret cannot complete the handshake, and what is sent is encrypted
    (CURVE: Curve25519 key exchange, XSalsa20-Poly1305, fresh keys per connection). Who a
    client is, is still told by the messages' signatures (`side_channel.Codec`): libzmq
    accepts any client key when no authentication handler runs, as here."""

    def __init__(self, secret: bytes) -> None:
        check_secret(secret)
        if not zmq.has("curve"):
            raise RuntimeError("turnkv: this pyzmq's libzmq has no CURVE support, which the "
                               "side channel's encryption needs (pyzmq's own wheels have it)")
        seed = hmac.new(secret, b"turnkv side channel: CURVE server key",
                        hashlib.sha256).digest()
        self._server_secret = z85.encode(seed)
        self.server_public = zmq.curve_public(self._server_secret)

    def serve(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before it binds) a CURVE server under the cluster's keypair."""
        socket.curve_secretkey = self._server_secret
        socket.curve_publickey = self.server_public
        socket.curve_server = True

    def connect(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before it connects) a CURVE client of the cluster's servers."""
        public, secret = zmq.curve_keypair()
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_serverkey = self.server_public
