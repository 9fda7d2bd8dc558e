"""The ambient session and the turn being sent, as context variables.

`with turnkv.session(...)` sets the ambient session for the code inside it (threads started
with `contextvars.copy_context()` and asyncio tasks inherit it). `Session.chat` / `stream`
pin the exact pending turn for the request they send, so that retries reuse its turn index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turnkv.core import SessionCore
    from turnkv.pending import PendingTurn

_session: ContextVar[SessionCore | None] = ContextVar("turnkv_session", default=None)
_turn: ContextVar[PendingTurn | None] = ContextVar("turnkv_turn", default=None)


def current_session() -> SessionCore | None:
    """The session of the innermost active `with turnkv.session(...)` / `client.session()`."""
    return _session.get()


def activate(session: SessionCore) -> Token[SessionCore | None]:
    return _session.set(session)


def deactivate(token: Token[SessionCore | None]) -> None:
    _session.reset(token)


def pinned_turn() -> PendingTurn | None:
    return _turn.get()


@contextlib.contextmanager
def pinning(pending: PendingTurn) -> Iterator[None]:
    token = _turn.set(pending)
    try:
        yield
    finally:
        _turn.reset(token)
