"""Hints a client sends between turns (`POST /v1/turnkv/sessions/{id}/hints`) reach the engines
that hold the session's leases, and the TTL the engines get follows the hints as the router's
own does. The engines are the aiohttp stand-ins of `test_router_engine_requests`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from aiohttp import web

from .test_router_engine_requests import (
    Cluster,
    Handler,
    StandIn,
    _ok,
    chat,
    cluster,
    prefill_ok,
    settle,
    slow_decode,
)


def params(seen_body: dict[str, Any]) -> dict[str, Any]:
    return dict(seen_body["kv_transfer_params"]["turnkv"])


def renewals(engine: StandIn) -> list[dict[str, Any]]:
    """The renew-only requests `engine` received: their bodies."""
    return [s.body for s in engine.requests("/v1/completions") if params(s.body).get("renew_only")]


def releases(engine: StandIn) -> int:
    return sum(1 for s in engine.requests("/v1/completions") if params(s.body).get("release"))


def push_backs(engine: StandIn) -> list[dict[str, Any]]:
    return [s.body for s in engine.requests("/v1/completions") if "receive" in params(s.body)]


async def answer(engine: StandIn, request: web.Request, body: dict[str, Any]
                 ) -> web.StreamResponse:
    return _ok({"choices": [{"index": 0, "text": "x"}]})


def pair(prefill_completions: Handler = answer, decode_completions: Handler = answer
         ) -> tuple[dict[str, Handler], dict[str, Handler]]:
    return ({"/v1/chat/completions": prefill_ok, "/v1/completions": prefill_completions},
            {"/v1/chat/completions": slow_decode, "/v1/completions": decode_completions})


async def first_turn(c: Cluster, client: httpx.AsyncClient, **hints: Any) -> str:
    """A whole turn of session "s" with its push back landed; returns the engines' lease key."""
    body = chat(stream=False)
    body["turnkv"] = {"session_id": "s", "hints": hints}
    reply = await client.post(f"{c.url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    await settle(c, lambda: bool(push_backs(c.prefill)))
    await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))
    return str(params(c.decode.requests("/v1/chat/completions")[0].body)["session"])


def renewal_counts(c: Cluster) -> dict[str, float]:
    counter = c.router.metrics.hint_renewals
    return {outcome: counter.labels(outcome)._value.get()  # type: ignore[attr-defined]
            for outcome in ("sent", "refused", "failed")}


def test_a_hint_between_turns_renews_the_session_on_both_engines() -> None:
    """The agent announces a long tool run after its turn: both engines renew the session's
    lease (the router's TTL for it, its priority, when it is back) and hold nothing of the
    one-token request; `final` on its own then releases both leases, renewing nothing."""

    async def main() -> None:
        async with cluster(*pair()) as c, httpx.AsyncClient(timeout=30) as client:
            key = await first_turn(c, client, priority=2)
            reply = await client.post(f"{c.url}/v1/turnkv/sessions/s/hints",
                                      json={"next_turn_in": 400, "priority": 4})
            assert reply.status_code == 200, reply.text
            assert reply.json()["expires_in_s"] > 590  # 1.5 x 400 s, within the 900 s cap
            await settle(c, lambda: bool(renewals(c.prefill)) and bool(renewals(c.decode)))
            for engine in (c.prefill, c.decode):
                [body] = renewals(engine)
                assert body["prompt"] == [0] and body["max_tokens"] == 1
                assert body["model"] == "m"
                # The same life of the session as the turn's (`epoch`).
                epoch = params(c.decode.requests("/v1/chat/completions")[0].body)["epoch"]
                assert params(body) == {"session": key, "renew_only": True, "ttl_s": 600.0,
                                        "priority": 4, "next_turn_in_s": 400, "epoch": epoch}
            assert renewal_counts(c) == {"sent": 2, "refused": 0, "failed": 0}
            reply = await client.post(f"{c.url}/v1/turnkv/sessions/s/hints",
                                      json={"final": True})
            assert reply.json() == {"session_id": "s", "released": True}
            await settle(c, lambda: releases(c.prefill) == releases(c.decode) == 1)
            assert len(renewals(c.prefill)) == len(renewals(c.decode)) == 1
            await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))

    asyncio.run(main())


def test_the_prefill_engine_renews_once_the_push_back_has_landed() -> None:
    """The push back replaces the prefill engine's lease with the turn's: a renewal sent
    before it lands would be undone by it."""
    gate = asyncio.Event()

    async def slow_push_back(engine: StandIn, request: web.Request, body: dict[str, Any]
                             ) -> web.StreamResponse:
        if "receive" in params(body):
            await gate.wait()
        return await answer(engine, request, body)

    async def main() -> None:
        async with cluster(*pair(prefill_completions=slow_push_back)) as c, \
                httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{c.url}/v1/chat/completions",
                                      json=chat(stream=False, session="s"))
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: bool(push_backs(c.prefill)))
            reply = await client.post(f"{c.url}/v1/turnkv/sessions/s/hints",
                                      json={"next_turn_in": 30})
            assert reply.status_code == 200, reply.text
            await settle(c, lambda: bool(renewals(c.decode)))
            await asyncio.sleep(0.3)
            assert renewals(c.prefill) == []  # the push back is still on its way
            gate.set()
            await settle(c, lambda: bool(renewals(c.prefill)))
            assert params(renewals(c.prefill)[0])["next_turn_in_s"] == 30

    asyncio.run(main())


def test_an_engine_that_fails_the_renewal_does_not_fail_the_hint_call() -> None:
    """A hint is advisory: an engine that drops the connection, or refuses, is logged and
    counted; the client's call succeeds and the other engine still renews."""

    async def drop(engine: StandIn, request: web.Request, body: dict[str, Any]
                   ) -> web.StreamResponse:
        if params(body).get("renew_only"):
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return await answer(engine, request, body)

    async def refuse(engine: StandIn, request: web.Request, body: dict[str, Any]
                     ) -> web.StreamResponse:
        if params(body).get("renew_only"):
            return _ok({"error": {"message": "no"}}, status=503)
        return await answer(engine, request, body)

    async def main() -> None:
        for prefill, decode, expected in ((drop, answer, {"sent": 1, "failed": 1}),
                                          (answer, refuse, {"sent": 1, "refused": 1})):
            async with cluster(*pair(prefill, decode)) as c, \
                    httpx.AsyncClient(timeout=30) as client:
                await first_turn(c, client)
                reply = await client.post(f"{c.url}/v1/turnkv/sessions/s/hints",
                                          json={"next_turn_in": 30})
                assert reply.status_code == 200, reply.text
                assert reply.json()["session_id"] == "s"
                await settle(c, lambda: sum(renewal_counts(c).values()) == 2)
                assert renewal_counts(c) == {"sent": 0, "refused": 0, "failed": 0, **expected}
                assert renewals(c.prefill) and renewals(c.decode)  # both were tried
                await settle(c, lambda: all(e.in_flight == 0 for e in c.router.pool.engines()))
                # The session goes on.
                reply = await client.post(f"{c.url}/v1/chat/completions",
                                          json=chat(stream=False, session="s"))
                assert reply.status_code == 200, reply.text

    asyncio.run(main())


def test_the_engines_lease_ttl_follows_the_hints_as_the_routers_does() -> None:
    """The router keeps a session 1.5 x `next_turn_in` (within its cap): so do the engines,
    on every request of the turn that leaves a lease (prefill, decode, push back). Without
    TTL hints the engines keep their own default."""

    def ttls(c: Cluster, turn: int) -> list[float | None]:
        bodies = [c.prefill.requests("/v1/chat/completions")[turn].body,
                  c.decode.requests("/v1/chat/completions")[turn].body,
                  push_backs(c.prefill)[turn]]
        return [params(body).get("ttl_s") for body in bodies]

    async def main() -> None:
        async with cluster(*pair()) as c, httpx.AsyncClient(timeout=30) as client:
            cases: list[tuple[dict[str, Any], float | None]] = [
                ({"next_turn_in": 400}, 600.0),  # 1.5 x 400 s
                ({"next_turn_in": 1000}, 900.0),  # the router's cap
                ({"ttl": 30, "next_turn_in": 4}, 30.0),  # the client's TTL covers the pause
                ({"ttl": 30}, 30.0),
                ({}, None),  # no hint: each engine's own default
            ]
            for turn, (hints, ttl) in enumerate(cases):
                body = chat(stream=False)
                body["turnkv"] = {"session_id": "s", "hints": hints}
                reply = await client.post(f"{c.url}/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                await settle(c, lambda turn=turn: len(push_backs(c.prefill)) == turn + 1)
                assert ttls(c, turn) == [ttl] * 3, hints

    asyncio.run(main())
