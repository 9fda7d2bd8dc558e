"""Conversations nobody tagged, recognised from their content: a turn that no key names
(`app.read_keys`), on any API with conversations (chat, Responses, Messages: their requests
read alike, `conversations.chat_messages`), and that continues a conversation this router
served (that turn's prompt, its reply, then more) is a turn of that conversation's session;
any other opens a session of its own, which its continuation then finds. Each such session
is a session like a tagged one (placed on its pair, held under a lease, pushed back, ended by
expiry), with an ID of the router's making and `session_source: "inferred"` in its stats.

A conversation is known by its digests (`conversations`) at its boundaries: the prompt of a
turn this router served and that turn's reply, together. A request is looked up at its last
assistant message, so only a conversation with the same history and the same reply matches,
and a shared system prompt (or shared first messages) never glues two conversations into one
session: their boundaries differ from the first reply on.

A conversation that branches (two continuations of one boundary: a regenerated answer, an
edited message, two agents forked from one history) keeps one continuation in the session:
the first to come while the boundary is the session's latest and no turn of it is in flight.
Any other continuation is a fork: a session of its own, placed where the parent's KV is
(the parent's prefix ID), which never changes the parent's history. A request that continues
an older boundary of a conversation (an edit before its last reply) forks the same way. The
router's token-history check stays the last line of defence: whatever the digests say, KV is
reused only up to the first token where a prompt departs from what the session's engines
hold.

Bounded: at most `max_entries` boundaries and as many sessions' latest boundaries, each
dropped after `max_age_s` without a turn (the longest lease: past it the session's KV is gone
anyway), on the session table's clock. Per router: another router (`--redis`) does not know
this one's boundaries, and its first turn of the conversation opens a session of its own.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from turnkv import protocol as p
from turnkv_server.router.conversations import (
    CONVERSATION_PATHS,
    PromptDigests,
    canonical,
    chain,
    prompt_digests,
)
from turnkv_server.router.sessions import SessionKey

INFERRED_PREFIX = "inf-"

Outcome = Literal["continued", "forked", "new"]
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class Inference:
    """The session a turn was found to belong to, and how."""

    session_id: str
    prefix_id: str  # the conversation's: a fork is placed where its parent is warm
    outcome: Outcome
    # Names this turn to `served` and `abandon`: a turn's end can come after its session's
    # next turn has begun (a stream's last chunk reaches the client before the relay ends).
    ticket: int = 0


@dataclass(frozen=True)
class _Boundary:
    key: SessionKey
    prefix_id: str
    at: float


@dataclass(frozen=True)
class _Pending:
    prompt: bytes
    prefix_id: str
    at: float
    ticket: int


class InferredSessions:
    """The router's table of conversation boundaries; touched only from the event loop."""

    def __init__(self, max_entries: int, max_age_s: float, clock: Callable[[], float],
                 on_infer: Callable[[Outcome], None] = lambda outcome: None) -> None:
        if max_entries < 1 or not max_age_s > 0:
            raise ValueError("inferred sessions need max_entries >= 1 and max_age_s > 0")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.clock = clock
        self._on_infer = on_infer
        self._tickets = itertools.count(1)
        self._boundaries: OrderedDict[bytes, _Boundary] = OrderedDict()
        # Each session's latest boundary: only there does a turn continue it.
        self._heads: OrderedDict[SessionKey, tuple[bytes, float]] = OrderedDict()
        # Sessions with a turn in flight: the prompt it answers, until `served` or `abandon`.
        self._pending: OrderedDict[SessionKey, _Pending] = OrderedDict()

    def __len__(self) -> int:
        return len(self._boundaries)

    def tag_for(self, path: str, body: dict[str, Any], tenant: str, prefix_id: str | None,
                ttl: float | None = None) -> p.TurnTag | None:
        """The tag of a turn no key named (`prefix_id`: its own, e.g. `prompt_cache_key`'s;
        `ttl`: `prompt_cache_retention`'s); None when it is no turn of a conversation (a
        completion, a request the engine will refuse)."""
        found = self.infer_turn(path, body, tenant, prefix_id, ttl)
        return found[0] if found is not None else None

    def infer_turn(self, path: str, body: dict[str, Any], tenant: str, prefix_id: str | None,
                   ttl: float | None = None) -> tuple[p.TurnTag, int] | None:
        """`tag_for`'s tag, and the ticket that names the turn to `served` and `abandon`."""
        digests = prompt_digests(body, tenant, path) if path in CONVERSATION_PATHS else None
        if digests is None:
            return None
        found = self.infer(tenant, digests, prefix_id)
        return p.TurnTag(session_id=found.session_id, prefix_id=found.prefix_id,
                         hints=p.CacheHints(ttl=ttl)), found.ticket

    def infer(self, tenant: str, digests: PromptDigests, prefix_id: str | None) -> Inference:
        """The session of a turn with these digests; it is in flight until `served` or
        `abandon`."""
        now = self.clock()
        self._expire(now)
        for depth, digest in enumerate(digests.boundaries):
            found = self._boundaries.get(digest)
            if found is None or found.key.tenant != tenant:
                continue
            head = self._heads.get(found.key)
            latest = depth == 0 and head is not None and head[0] == digest
            if latest and found.key not in self._pending:
                return self._begin(found.key, digests, found.prefix_id, "continued", now)
            return self._begin(_new_key(tenant), digests, found.prefix_id, "forked", now)
        key = _new_key(tenant)
        return self._begin(key, digests, prefix_id or key.session_id, "new", now)

    def served(self, key: SessionKey, reply: dict[str, Any] | None,
               ticket: int | None = None) -> None:
        """The turn of `key` in flight (the one `ticket` names, where given) was answered with
        `reply` (the assistant message): its prompt and reply are the session's latest
        boundary."""
        pending = self._take(key, ticket)
        if pending is None or reply is None:
            return
        now = self.clock()
        head = chain(pending.prompt, canonical(reply))
        self._boundaries[head] = _Boundary(key, pending.prefix_id, now)
        self._boundaries.move_to_end(head)
        self._heads[key] = (head, now)
        self._heads.move_to_end(key)
        self._expire(now)

    def abandon(self, key: SessionKey, ticket: int | None = None) -> None:
        """The turn of `key` in flight (the one `ticket` names, where given) ended without a
        reply: the session's latest boundary stays what it was. (Once `served`, nothing; nor
        for a ticket whose turn is no longer the one in flight: the session's next turn may
        have begun before this one's end was told.)"""
        self._take(key, ticket)

    def _take(self, key: SessionKey, ticket: int | None) -> _Pending | None:
        pending = self._pending.get(key)
        if pending is None or (ticket is not None and pending.ticket != ticket):
            return None
        del self._pending[key]
        return pending

    def _begin(self, key: SessionKey, digests: PromptDigests, prefix_id: str,
               outcome: Outcome, now: float) -> Inference:
        ticket = next(self._tickets)
        self._pending[key] = _Pending(digests.prompt, prefix_id, now, ticket)
        self._pending.move_to_end(key)
        self._on_infer(outcome)
        return Inference(key.session_id, prefix_id, outcome, ticket)

    def _expire(self, now: float) -> None:
        """Oldest first (each table is in the order of its entries' times): those past the
        age, then those over the count."""
        oldest = now - self.max_age_s
        _trim(self._boundaries, lambda b: b.at, oldest, self.max_entries)
        _trim(self._heads, lambda h: h[1], oldest, self.max_entries)
        _trim(self._pending, lambda q: q.at, oldest, self.max_entries)


def _trim(table: OrderedDict[K, V], at: Callable[[V], float], oldest: float,
          count: int) -> None:
    while table and (len(table) > count or at(next(iter(table.values()))) <= oldest):
        table.popitem(last=False)


def _new_key(tenant: str) -> SessionKey:
    return SessionKey(tenant, INFERRED_PREFIX + uuid.uuid4().hex)
