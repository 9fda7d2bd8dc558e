"""Every error the router answers is in its client's shape: OpenAI's on every route, unknown
ones included, Anthropic's on `/v1/messages` and under it (`turnkv_server.router.errors`).
Through the app in front of stand-in engines, and through the openai and anthropic clients
themselves: the message has to reach the exception a caller sees.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.unit.test_router_affinity import StandIn, affinity_router
from turnkv_server.router.app import create_app
from turnkv_server.router.config import RouterConfig


def openai_error(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def anthropic_error(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    error = body["error"]
    assert set(error) == {"type", "message"} and error["message"], error
    return dict(error)


class Hints(BaseModel):
    ttl: float


def app_with_test_routes() -> Any:
    """The router's app, plus two routes that only a test has: one whose body a model checks
    (FastAPI's validation error) and one that raises."""
    app = create_app(RouterConfig(mode="affinity", engine=["http://127.0.0.1:9"],
                                  health_interval=60.0))

    @app.post("/v1/test/validated")
    async def validated(hints: Hints) -> dict[str, float]:
        return {"ttl": hints.ttl}

    @app.post("/v1/test/crash")
    async def crash() -> None:
        raise RuntimeError("a bug")

    @app.post("/v1/messages/test/crash")
    async def crash_anthropic() -> None:
        raise RuntimeError("a bug")

    return app


def test_unknown_routes_and_methods_answer_in_openai_shape() -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=app_with_test_routes(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            missing = await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
            assert missing.status_code == 404
            error = openai_error(missing)
            assert "/v1/embeddings" in error["message"] and error["code"] == 404
            wrong_method = await client.get("/v1/chat/completions")
            assert wrong_method.status_code == 405
            assert "GET" in openai_error(wrong_method)["message"]
            assert wrong_method.headers.get("allow") == "POST"
            invalid = await client.post("/v1/test/validated", json={"ttl": "soon"})
            assert invalid.status_code == 400
            error = openai_error(invalid)
            assert error["param"] == "ttl" and error["type"] == "invalid_request_error"
            crashed = await client.post("/v1/test/crash")
            assert crashed.status_code == 500
            error = openai_error(crashed)
            assert "RuntimeError" in error["message"] and "a bug" not in error["message"]
    asyncio.run(main())


def test_errors_under_v1_messages_answer_in_anthropic_shape() -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=app_with_test_routes(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            missing = await client.post("/v1/messages/no-such-thing", json={})
            assert missing.status_code == 404
            assert anthropic_error(missing)["type"] == "not_found_error"
            crashed = await client.post("/v1/messages/test/crash")
            assert crashed.status_code == 500
            assert anthropic_error(crashed)["type"] == "api_error"
            # Only the Messages API's own paths: a look-alike keeps OpenAI's shape.
            assert openai_error(await client.post("/v1/messagesx", json={}))
    asyncio.run(main())


@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", openai_error),
                                              ("/v1/messages", anthropic_error)])
def test_a_turn_that_fails_unexpectedly_is_a_500_in_its_apis_shape_and_raised_on(
        path: str, shape: Any) -> None:
    """The turn routes are served ahead of Starlette's error middleware (`RouterApp`): what it
    did for them, `_serve_turn` does, a 500 in the API's shape and the exception raised on
    for the server to log."""
    app = app_with_test_routes()

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    app.state.router.turns.serve = broken

    async def main() -> None:
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        quiet = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=quiet, base_url="http://router") as client:
            crashed = await client.post(path, json=body)
            assert crashed.status_code == 500
            assert "RuntimeError" in shape(crashed)["message"]
            assert "a bug" not in crashed.text
        loud = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=loud, base_url="http://router") as client:
            with pytest.raises(RuntimeError, match="a bug"):
                await client.post(path, json=body)
    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_the_routers_own_refusals_are_openai_shaped(stream: bool) -> None:
    async def main() -> None:
        async with affinity_router([StandIn()]) as (_, url), \
                httpx.AsyncClient(timeout=30) as client:
            bad = await client.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "stream": stream})
            assert bad.status_code == 400 and openai_error(bad)["param"] == "n"
    asyncio.run(main())


def test_the_clients_see_the_routers_message() -> None:
    """openai-python and the anthropic SDK put the message of their own shape into the
    exception; FastAPI's `{"detail": "Not Found"}` gave `Error code: 404` and nothing more."""
    async def main() -> None:
        async with affinity_router([StandIn()]) as (_, url):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.NotFoundError) as info:
                await client.embeddings.create(model="m", input="hello")
            assert "Invalid URL (POST /v1/embeddings)" in str(info.value)
            assert info.value.type == "not_found_error"
            await client.close()
            claude = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
            with pytest.raises(anthropic.NotFoundError) as found:
                await claude.post("/v1/messages/no-such-thing", body={}, cast_to=object)
            assert "/v1/messages/no-such-thing" in str(found.value)
            await claude.close()
    asyncio.run(main())
