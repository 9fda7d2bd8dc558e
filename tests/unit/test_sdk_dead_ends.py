"""Where a user is stuck, the SDK says why: a closed session refuses hints as it refuses
turns, a URL where no server answers is named with how to check it, and a session the router
no longer holds is a typed error with the router's own words. Real sockets, no engines."""

from __future__ import annotations

import asyncio
import http.server
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import turnkv
from tests.support.local_servers import serving_http
from turnkv.session_api import refusal
from turnkv_server.router.errors import error_response

MESSAGES = [{"role": "user", "content": "hi"}]
FAST = turnkv.RetryPolicy(attempts=2, initial_wait_s=0.01)


@pytest.fixture
def refused_url() -> Iterator[str]:
    """The base URL of a port that is bound but not listening (as after `turnkv down`, or a
    router still starting): every connection is refused, and no other process can take the
    port while the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def check_unreachable(exc: BaseException, url: str) -> None:
    # Existing `except openai.APIConnectionError` handlers still catch it.
    assert isinstance(exc, turnkv.ServerUnreachableError)
    assert isinstance(exc, openai.APIConnectionError)
    assert isinstance(exc, turnkv.TurnKVError)
    message = str(exc)
    assert f"no server answers at {url} " in message
    assert "(connection refused)" in message
    assert "turnkv status" in message
    assert exc.url == url


# -- a closed session ------------------------------------------------------------------------

def test_a_closed_session_refuses_hints_as_it_refuses_turns(refused_url: str) -> None:
    client = turnkv.OpenAI(base_url=refused_url, api_key="k")
    session = client.session()
    session.close(final=False)
    with pytest.raises(turnkv.SessionClosedError, match="is closed"):
        session.chat(model="m", messages=MESSAGES)
    with pytest.raises(turnkv.SessionClosedError, match="is closed"):
        session.hint(next_turn_in=5)
    # Nothing changed: the refused hint is not carried anywhere.
    assert session.hints.next_turn_in is None

    with turnkv.session() as ambient:
        pass
    with pytest.raises(turnkv.SessionClosedError):
        ambient.hint(final=True)


def test_a_closed_async_session_refuses_hints(refused_url: str) -> None:
    async def main() -> None:
        client = turnkv.AsyncOpenAI(base_url=refused_url, api_key="k")
        async with client.session(keep=True) as session:
            session.hint(ttl=30)
        with pytest.raises(turnkv.SessionClosedError):
            session.hint(ttl=60)
        with pytest.raises(turnkv.SessionClosedError):
            await session.chat(model="m", messages=MESSAGES)

    asyncio.run(main())


# -- no server at the URL --------------------------------------------------------------------

def test_no_server_names_the_url_and_how_to_check(refused_url: str) -> None:
    client = turnkv.OpenAI(base_url=refused_url, api_key="k")
    with client.session(retry=FAST) as session:
        started = time.monotonic()
        with pytest.raises(openai.APIConnectionError) as chat:
            session.chat(model="m", messages=MESSAGES)
        assert time.monotonic() - started < 5
        check_unreachable(chat.value, refused_url)
        with pytest.raises(openai.APIConnectionError) as stream:
            session.stream(model="m", messages=MESSAGES)
        check_unreachable(stream.value, refused_url)
        # The turn that never got through gave its index back.
        assert session.turn == 1
        with pytest.raises(turnkv.ServerUnreachableError) as hints:
            session.hint_now(next_turn_in=5)
        check_unreachable(hints.value, refused_url)
        with pytest.raises(turnkv.ServerUnreachableError) as release:
            session.release()
        check_unreachable(release.value, refused_url)

    # The client outside any session, and a stock openai client inside `turnkv.session()`.
    with pytest.raises(openai.APIConnectionError) as plain:
        client.with_options(max_retries=0).chat.completions.create(model="m",
                                                                   messages=MESSAGES)
    check_unreachable(plain.value, refused_url)
    stock = openai.OpenAI(base_url=refused_url, api_key="k", max_retries=0)
    with turnkv.session(retry=FAST), pytest.raises(openai.APIConnectionError) as ambient:
        stock.chat.completions.create(model="m", messages=MESSAGES)
    check_unreachable(ambient.value, refused_url)
    # Outside a session a stock client is not turnkv's to explain.
    with pytest.raises(openai.APIConnectionError) as untouched:
        stock.chat.completions.create(model="m", messages=MESSAGES)
    assert not isinstance(untouched.value, turnkv.ServerUnreachableError)


def test_no_server_async(refused_url: str) -> None:
    async def main() -> list[BaseException]:
        client = turnkv.AsyncOpenAI(base_url=refused_url, api_key="k")
        errors: list[BaseException] = []
        async with client.session(retry=FAST) as session:
            for call in (session.chat, session.stream):
                try:
                    await call(model="m", messages=MESSAGES)
                except openai.APIConnectionError as exc:
                    errors.append(exc)
            try:
                await session.hint_now(ttl=5)
            except turnkv.ServerUnreachableError as exc:
                errors.append(exc)
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 3
    for exc in errors:
        check_unreachable(exc, refused_url)


def test_a_timeout_stays_a_timeout() -> None:
    """A server that accepts and never answers is there: not "no server answers"."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        client = turnkv.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=0.3)
        with client.session(retry=FAST) as session, \
                pytest.raises(openai.APITimeoutError) as caught:
            session.chat(model="m", messages=MESSAGES)
    assert not isinstance(caught.value, turnkv.ServerUnreachableError)


# -- a session the router no longer holds ------------------------------------------------------

class RouterLike(http.server.BaseHTTPRequestHandler):
    """Answers the session API as the router does for a session it does not hold: the
    router's own `error_response`."""

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        session_id = self.path.split("/")[-2]
        answer = error_response(404, f"no live session {session_id!r}")
        body = bytes(answer.body)
        self.send_response(answer.status_code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_DELETE = do_POST  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def router_like() -> Iterator[str]:
    with serving_http(RouterLike) as url:
        yield f"{url}/v1"


def test_hint_now_on_a_session_the_router_no_longer_holds(router_like: str) -> None:
    client = turnkv.OpenAI(base_url=router_like, api_key="k")
    session = client.session("s-expired")
    with pytest.raises(turnkv.SessionNotFoundError) as caught:
        session.hint_now(next_turn_in=5)
    error = caught.value
    assert isinstance(error, turnkv.SessionAPIError) and isinstance(error, turnkv.TurnKVError)
    assert error.status_code == 404 and error.kind == "not_found_error"
    message = str(error)
    assert message.startswith("no live session 's-expired': ")
    assert "lease expired" in message
    assert "{" not in message  # the router's words, not its JSON
    # release() still answers False for a session the router does not hold.
    assert session.release() is False

    async def main() -> None:
        other = turnkv.AsyncOpenAI(base_url=router_like, api_key="k").session("s-expired")
        with pytest.raises(turnkv.SessionNotFoundError):
            await other.hint_now(ttl=5)

    asyncio.run(main())


@pytest.mark.parametrize(("status", "body", "kind", "says"), [
    (404, {"error": {"message": "no live session 's-1'", "type": "not_found_error"}},
     turnkv.SessionNotFoundError, "no live session 's-1': the router does not hold"),
    (401, {"error": {"message": "missing or unknown API key"}}, turnkv.SessionAPIError,
     "answered 401: missing or unknown API key"),
    (502, ["not", "an", "error"], turnkv.SessionAPIError, 'answered 502: ["not"'),
    (503, "<html>proxy</html>", turnkv.SessionAPIError, "answered 503: <html>proxy</html>"),
])
def test_every_refusal_is_typed(status: int, body: Any, kind: type[Exception],
                                says: str) -> None:
    request = httpx.Request("POST", "http://router/v1/turnkv/sessions/s-1/hints")
    response = (httpx.Response(status, text=body, request=request) if isinstance(body, str)
                else httpx.Response(status, json=body, request=request))
    error = refusal(response)
    assert type(error) is kind and error.status_code == status
    assert says in str(error)
