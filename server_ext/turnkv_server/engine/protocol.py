"""The turnkv engine protocol: what the router tells a turnkv engine about one request, and what
the engine answers, both inside `kv_transfer_params["turnkv"]`.

The router talks to engines only through their HTTP API; the per-request instructions ride in
``kv_transfer_params["turnkv"]`` of the request, which vLLM hands to the connector untouched,
and the connector's answer comes back in the same place of a non-streamed response. This module
is the one definition of both shapes, imported by the router (which writes `TurnParams` and
reads `TurnReply`) and by the connector (which reads the one and writes the other); neither
imports the other. Standard library only.

One request may carry (`TurnParams`):
- ``session``: the lease key. After the request the engine keeps its blocks for the session,
  for ``ttl_s`` seconds at most (the engine's operator caps it), at ``priority``; with
  ``next_turn_in_s`` (the client's hint: seconds until the session's next turn), the lease
  records when the session is expected back, which orders evictions under memory pressure;
- ``release``: the session has ended (``final`` or DELETE): hold nothing, drop its lease;
- ``renew_only``: a hint sent between turns: renew the session's lease (``ttl_s``,
  ``priority``, ``next_turn_in_s``) and hold nothing of this request (a one-token control
  request, which would otherwise replace the lease with its own blocks); no lease, no effect;
- ``receive``: the request's missing KV arrives from ``peer`` (a side-channel address) under
  ``transfer_id``; the peer holds ``peer_tokens`` tokens of this prompt (``None``: all of it);
  after ``timeout_s`` (at most the engine's own limit) the blocks are recomputed instead;
- ``send``: when the request ends, its blocks go to whichever engine registers ``transfer_id``;
  with ``stream`` the engine also writes them layer by layer while it computes the prompt, to a
  receiver that registered already (the prefill-to-decode send: a decode engine's send back to
  prefill has no receiver before it ends, so streaming it would be wasted work);
- ``abandon``: transfer IDs of this engine's sends to give up now: the router knows their
  receiver will never register (the push back is not coming), so their blocks go back at once
  instead of after the send timeout;
- ``epoch``: which life of ``session`` the request belongs to (a number that grows each time
  the router opens the session again after it ended). A ``release`` ends every life up to its
  epoch: a request of such a life that ends later (a prefetch or push back in flight at the
  DELETE, or one the release overtook) holds nothing and renews nothing, and a release of an
  earlier life leaves a later life's lease alone. Without an epoch, none of this is checked.

The engine answers (`TurnReply`) with the blocks it now holds for the session and where the
prompt's tokens came from: its own prefix hit, written by the peer, or (what is left) computed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

KEY = "turnkv"
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_PEER = re.compile(r"[A-Za-z0-9_.-]+:\d{1,5}")
# One request may abandon this many sends: the router abandons one or two at a time.
MAX_ABANDON = 64


class BadParams(ValueError):
    """`kv_transfer_params["turnkv"]` is malformed; the message names the field."""


@dataclass(frozen=True)
class Receive:
    transfer_id: str
    peer: str
    peer_tokens: int | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class Send:
    transfer_id: str
    stream: bool = False


@dataclass(frozen=True)
class TurnParams:
    session: str | None = None
    ttl_s: float | None = None
    priority: int = 0
    release: bool = False
    receive: Receive | None = None
    send: Send | None = None
    abandon: tuple[str, ...] = ()
    next_turn_in_s: float | None = None
    renew_only: bool = False
    epoch: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """The dict to put under ``kv_transfer_params["turnkv"]``; unset fields left out."""
        # `asdict`'s result, without its deep copy of every value (the router writes these on
        # every request, and that copy was most of their cost): the fields are flat.
        wire = {k: v for k, v in vars(self).items() if v not in (None, False, ())}
        if self.receive is not None:
            wire["receive"] = dict(vars(self.receive))
        if self.send is not None:
            wire["send"] = dict(vars(self.send))
        if self.next_turn_in_s is not None:
            # 0.0 == False: the filter above drops "back at once", which is a hint.
            wire["next_turn_in_s"] = self.next_turn_in_s
        if self.epoch is not None:
            wire["epoch"] = self.epoch  # (0 == False: dropped above)
        if self.priority == 0:
            wire.pop("priority", None)
        if self.send is not None and not self.send.stream:
            wire["send"].pop("stream")
        if self.abandon:
            wire["abandon"] = list(self.abandon)
        return wire


def parse(kv_transfer_params: dict[str, Any] | None) -> TurnParams | None:
    """The turnkv part of a request's params, or None when it has none."""
    if not kv_transfer_params or KEY not in kv_transfer_params:
        return None
    raw = kv_transfer_params[KEY]
    if not isinstance(raw, dict):
        raise BadParams(f"kv_transfer_params.{KEY} must be an object")
    session = _optional_str(raw, "session")
    ttl = raw.get("ttl_s")
    if ttl is not None and (not isinstance(ttl, (int, float)) or isinstance(ttl, bool)
                            or ttl <= 0):
        raise BadParams(f"{KEY}.ttl_s must be a positive number")
    next_turn_in = raw.get("next_turn_in_s")
    if next_turn_in is not None and (not isinstance(next_turn_in, (int, float))
                                     or isinstance(next_turn_in, bool)
                                     or not 0 <= next_turn_in < math.inf):
        # (`not 0 <= x` refuses NaN too: it would make every comparison of leases false.)
        raise BadParams(f"{KEY}.next_turn_in_s must be a non-negative number")
    priority = raw.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise BadParams(f"{KEY}.priority must be an integer")
    release, renew_only = raw.get("release", False), raw.get("renew_only", False)
    if not isinstance(release, bool):
        raise BadParams(f"{KEY}.release must be true or false")
    if not isinstance(renew_only, bool):
        raise BadParams(f"{KEY}.renew_only must be true or false")
    epoch = raw.get("epoch")
    if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)
                              or not 0 <= epoch < 2**63):
        raise BadParams(f"{KEY}.epoch must be a non-negative integer")
    receive, send = _receive(raw.get("receive")), _send(raw.get("send"))
    if renew_only and (session is None or release or receive or send):
        raise BadParams(f"{KEY}.renew_only needs a session, and no release, receive or send")
    return TurnParams(session=session, ttl_s=None if ttl is None else float(ttl),
                      priority=priority, release=release, receive=receive, send=send,
                      abandon=_abandon(raw.get("abandon", ())),
                      next_turn_in_s=None if next_turn_in is None else float(next_turn_in),
                      renew_only=renew_only, epoch=epoch)


def _receive(raw: Any) -> Receive | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadParams(f"{KEY}.receive must be an object")
    peer = raw.get("peer")
    if not isinstance(peer, str) or not _PEER.fullmatch(peer):
        raise BadParams(f"{KEY}.receive.peer must be HOST:PORT")
    tokens = raw.get("peer_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)
                               or tokens < 0):
        raise BadParams(f"{KEY}.receive.peer_tokens must be a non-negative integer")
    timeout = raw.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or timeout <= 0):
        raise BadParams(f"{KEY}.receive.timeout_s must be a positive number")
    return Receive(_transfer_id(raw, "receive"), peer, tokens,
                   None if timeout is None else float(timeout))


def _send(raw: Any) -> Send | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadParams(f"{KEY}.send must be an object")
    stream = raw.get("stream", False)
    if not isinstance(stream, bool):
        raise BadParams(f"{KEY}.send.stream must be true or false")
    return Send(_transfer_id(raw, "send"), stream)


def _abandon(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_ABANDON or not all(
            isinstance(t, str) and _TRANSFER_ID.fullmatch(t) for t in raw):
        raise BadParams(f"{KEY}.abandon must be a list of at most {MAX_ABANDON} transfer IDs "
                        "(1-128 characters of letters, digits and _.:-)")
    return tuple(raw)


def _transfer_id(raw: dict[str, Any], where: str) -> str:
    value = raw.get("transfer_id")
    if not isinstance(value, str) or not _TRANSFER_ID.fullmatch(value):
        raise BadParams(f"{KEY}.{where}.transfer_id must be 1-128 characters of "
                        "letters, digits and _.:-")
    return value


def _optional_str(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value or len(value) > 512):
        raise BadParams(f"{KEY}.{key} must be a non-empty string of at most 512 characters")
    return value


@dataclass(frozen=True)
class TurnReply:
    """A turnkv engine's answer about one finished request."""

    held_blocks: int = 0  # blocks held for the session's lease
    local_tokens: int = 0  # prompt tokens found in the engine's own prefix cache
    received_tokens: int = 0  # prompt tokens the peer wrote (0 when the receive failed)
    receive_failed: bool = False  # the peer's KV did not arrive: the engine recomputed it
    # From the request's blocks being allocated to a lower tier's load into them ending, ms;
    # None when no tier loaded anything for it.
    restore_ms: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "restore_ms" or v is not None}

    @classmethod
    def from_wire(cls, raw: Any) -> TurnReply:
        if not isinstance(raw, dict):
            raise BadParams(f"the reply's {KEY} must be an object")
        return cls(held_blocks=int(raw.get("held_blocks", 0)),
                   local_tokens=int(raw.get("local_tokens", 0)),
                   received_tokens=int(raw.get("received_tokens", 0)),
                   receive_failed=bool(raw.get("receive_failed", False)),
                   restore_ms=_optional_ms(raw.get("restore_ms")))


def _optional_ms(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def parse_reply(kv_transfer_params: dict[str, Any] | None) -> TurnReply | None:
    """The turnkv engine's reply in a response's params, or None when it has none (another
    connector's params, or a streamed response, which carries none)."""
    if not kv_transfer_params or not isinstance(kv_transfer_params.get(KEY), dict):
        return None
    return TurnReply.from_wire(kv_transfer_params[KEY])
