"""The adapters release the sessions they open: on `close()` / `aclose()`, at the end of a
`with` / `async with` block, and when the model object is garbage-collected without being
closed; never a session the caller passed in, nor one opened with `keep=True`; and at
interpreter exit they send nothing (no request holds the exit up or fails during it).

Each adapter talks to `tests.support.fake_router`: `FakeServer`'s turns over a local socket,
with the router's `DELETE /v1/turnkv/sessions/{id}`, which it records.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage

import turnkv
from tests.support.fake_router import FakeRouter, fake_router
from turnkv.integrations.langchain import ChatTurnKV
from turnkv.integrations.llamaindex import TurnKVLLM
from turnkv.integrations.turns import RELEASE_THREAD

ROOT = Path(__file__).resolve().parents[2]


def langchain_model(url: str, **session: Any) -> ChatTurnKV:
    return ChatTurnKV(model="m", base_url=url, api_key="k", max_retries=0, **session)


def llamaindex_model(url: str, **session: Any) -> TurnKVLLM:
    return TurnKVLLM(model="m", api_base=url, api_key="k", max_retries=0, **session)


def one_turn(model: Any) -> None:
    if isinstance(model, ChatTurnKV):
        model.invoke([HumanMessage("hi")])
    else:
        model.chat([ChatMessage(role="user", content="hi")])


async def one_async_turn(model: Any) -> None:
    if isinstance(model, ChatTurnKV):
        await model.ainvoke([HumanMessage("hi")])
    else:
        await model.achat([ChatMessage(role="user", content="hi")])


Factory = Callable[..., Any]
ADAPTERS = pytest.mark.parametrize("make", [langchain_model, llamaindex_model],
                                   ids=["langchain", "llamaindex"])


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    with fake_router() as running:
        yield running


def collect() -> None:
    """A garbage collection, and the end of every release it started (they run in threads
    of their own)."""
    gc.collect()
    for thread in threading.enumerate():
        if thread.name.startswith(RELEASE_THREAD):
            thread.join(timeout=30)


@ADAPTERS
def test_a_collected_model_releases_the_session_it_opened(router: FakeRouter,
                                                          make: Factory) -> None:
    model = make(router.url)
    one_turn(model)
    session_id = model.session.id
    del model
    collect()
    assert router.released == [session_id]


@ADAPTERS
def test_close_releases_at_once_and_only_once(router: FakeRouter, make: Factory) -> None:
    model = make(router.url)
    one_turn(model)
    model.close()
    assert router.released == [model.session.id]
    model.close()
    del model
    collect()
    assert len(router.released) == 1


@ADAPTERS
def test_with_and_async_with_release_at_the_end_of_the_block(router: FakeRouter,
                                                             make: Factory) -> None:
    with make(router.url) as model:
        one_turn(model)
        assert router.released == []
    assert router.released == [model.session.id]

    async def main() -> str:
        async with make(router.url) as inner:
            await one_async_turn(inner)
            assert len(router.released) == 1
        return str(inner.session.id)

    second = asyncio.run(main())
    assert router.released[1:] == [second]


@ADAPTERS
def test_a_copy_keeps_the_session_until_the_last_one_goes(router: FakeRouter,
                                                          make: Factory) -> None:
    model = make(router.url)
    one_turn(model)
    copied = model.model_copy()
    session_id = model.session.id
    del model
    collect()
    assert router.released == []
    one_turn(copied)  # the session is still open: the copy goes on with it
    del copied
    collect()
    assert router.released == [session_id]


@ADAPTERS
def test_a_given_session_stays_its_owners(router: FakeRouter, make: Factory) -> None:
    session = turnkv.session(ttl=60)
    model = make(router.url, session=session)
    one_turn(model)
    model.close()
    del model
    collect()
    assert router.released == [] and not session.closed
    session.close()  # its owner's call
    assert router.released == [session.id]


@ADAPTERS
def test_keep_leaves_the_session_to_its_lease(router: FakeRouter, make: Factory) -> None:
    model = make(router.url, keep=True)
    one_turn(model)
    session = model.session
    del model
    collect()
    assert router.released == []
    assert session.closed  # closed for turns all the same


@ADAPTERS
def test_a_collection_without_a_reachable_router_raises_nothing(make: Factory) -> None:
    with fake_router() as gone:
        model = make(gone.url)
        one_turn(model)
    # The router is down: the release fails in its thread, logged, never raised.
    del model
    collect()


EXIT_SCRIPT = """
    import sys
    from langchain_core.messages import HumanMessage
    from llama_index.core.base.llms.types import ChatMessage
    from turnkv.integrations.langchain import ChatTurnKV
    from turnkv.integrations.llamaindex import TurnKVLLM

    url = sys.argv[1]
    chat = ChatTurnKV(model="m", base_url=url, api_key="k", max_retries=0)
    chat.invoke([HumanMessage("hi")])
    llm = TurnKVLLM(model="m", api_base=url, api_key="k", max_retries=0)
    llm.chat([ChatMessage(role="user", content="hi")])
    print("played", chat.session.id, llm.session.id)
    # Exits with both models alive.
"""


def test_interpreter_exit_sends_nothing_and_says_nothing(router: FakeRouter) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "sdk"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), router.url],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("played ")
    assert done.stderr == ""
    assert router.released == []
