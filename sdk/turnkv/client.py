"""`turnkv.OpenAI` and `turnkv.AsyncOpenAI`: openai's clients, plus `session()`.

Same constructor and every openai call unchanged. Unless an `http_client` is given, they send
through `turnkv.http_client()`, which tags the turns of the active session; with an
`http_client` of your own, the openai patch (see `turnkv.openai_patch`) does the tagging.
"""

from __future__ import annotations

from typing import Any

import openai

from turnkv.async_sessions import AsyncSession
from turnkv.core import WarnOnce
from turnkv.http import async_http_client, http_client
from turnkv.openai_patch import install
from turnkv.retry import RetryPolicy
from turnkv.sessions import Session


class OpenAI(openai.OpenAI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("http_client") is None:
            kwargs["http_client"] = http_client()
        super().__init__(*args, **kwargs)
        # One plain-server warning per client, whatever the number of sessions.
        self._turnkv_warn_once = WarnOnce()
        install()

    def session(self, id: str | None = None, *, ttl: float | None = None,
                priority: int | None = None, prefix_id: str | None = None, keep: bool = False,
                retry: RetryPolicy | None = None, timeout: float | None = None) -> Session:
        """A session on this client; see `turnkv.Session`. `id` None: a random valid ID."""
        return Session(id, ttl=ttl, priority=priority, prefix_id=prefix_id, keep=keep,
                       client=self, retry=retry, timeout=timeout)


class AsyncOpenAI(openai.AsyncOpenAI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("http_client") is None:
            kwargs["http_client"] = async_http_client()
        super().__init__(*args, **kwargs)
        self._turnkv_warn_once = WarnOnce()
        install()

    def session(self, id: str | None = None, *, ttl: float | None = None,
                priority: int | None = None, prefix_id: str | None = None, keep: bool = False,
                retry: RetryPolicy | None = None, timeout: float | None = None
                ) -> AsyncSession:
        """A session on this client; see `turnkv.AsyncSession`."""
        return AsyncSession(id, ttl=ttl, priority=priority, prefix_id=prefix_id, keep=keep,
                            client=self, retry=retry, timeout=timeout)
