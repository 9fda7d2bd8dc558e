"""A tenant's clients cannot order leases above other tenants': the operator caps the priority
a tenant's clients may ask for (by default no tenant above another) and sets a floor under the
return they may announce (`next_turn_in`), and the router holds every hint to them, in a turn's
tag and between turns, before the engines or its own session table see it.

Through the router, under uvicorn, in front of the stand-in engine of `test_router_affinity`
(aggregated, running the turnkv connector: every turn tells it the session's lease).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.test_router_affinity import StandIn, affinity_router
from turnkv.protocol import MAX_PRIORITY, CacheHints
from turnkv_server.engine.protocol import TurnParams, parse
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.tenants import TenantCaps

KEYS = {"key-greedy": "greedy", "key-other": "other", "key-trusted": "trusted"}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{tenant}"}


def chat(session: str, **hints: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "turnkv": {"session_id": session, "hints": hints}}


def leases(engine: StandIn) -> list[TurnParams]:
    """The lease each request to `engine` carried, in order."""
    found = [parse(body.get("kv_transfer_params")) for body in engine.seen]
    return [params for params in found if params is not None]


# -- the rule --------------------------------------------------------------------------------------


def test_a_cap_lowers_priority_and_raises_next_turn_in_and_leaves_the_rest() -> None:
    caps = TenantCaps(max_priority=2, min_next_turn_in=5.0)
    assert caps.apply(CacheHints(priority=7, next_turn_in=0.0, ttl=30)) == CacheHints(
        priority=2, next_turn_in=5.0, ttl=30)
    # Clients may lower their priority, and announce a later return, as they like.
    assert caps.apply(CacheHints(priority=-4, next_turn_in=60.0)) == CacheHints(
        priority=-4, next_turn_in=60.0)
    # No hint: none made up (a session without priority counts as 0, within the cap)...
    assert caps.apply(CacheHints()) == CacheHints()
    # ...unless the cap is below 0: then no priority is the cap.
    assert TenantCaps(max_priority=-3).apply(CacheHints(final=True)) == CacheHints(
        priority=-3, final=True)
    with pytest.raises(ValueError, match="max_priority"):
        TenantCaps(max_priority=MAX_PRIORITY + 1)
    with pytest.raises(ValueError, match="min_next_turn_in"):
        TenantCaps(min_next_turn_in=-1.0)


def test_the_operator_sets_caps_per_tenant_and_a_default_for_the_rest(tmp_path: Path) -> None:
    from turnkv_server.router.__main__ import parse_args
    from turnkv_server.router.config import from_args

    keys, caps = tmp_path / "keys.json", tmp_path / "caps.json"
    keys.write_text(json.dumps(KEYS))
    caps.write_text(json.dumps({"trusted": {"max_priority": 5}}))
    engines = ["--mode", "affinity", "--engine", "http://e"]
    config = from_args(parse_args([*engines, "--api-keys", str(keys), "--tenant-caps",
                                   str(caps), "--min-next-turn-in", "2"]))
    assert config.caps_for("trusted") == TenantCaps(max_priority=5, min_next_turn_in=2.0)
    # Tenants without caps of their own: none above another, unless the operator says.
    assert config.caps_for("greedy") == TenantCaps(max_priority=0, min_next_turn_in=2.0)
    config = from_args(parse_args([*engines, "--api-keys", str(keys), "--max-priority", "3"]))
    assert config.caps_for("greedy").max_priority == 3
    # Without API keys there is one tenant, and nobody else to push out: uncapped.
    assert from_args(parse_args(engines)).caps_for("default") == TenantCaps(MAX_PRIORITY, 0.0)
    caps.write_text(json.dumps({"trusted": {"max_priority": 5, "burst": 1}}))
    with pytest.raises(SystemExit, match="burst"):
        from_args(parse_args([*engines, "--tenant-caps", str(caps)]))
    with pytest.raises(ValueError, match="no tenant 'typo'"):
        RouterConfig(mode="affinity", engine=["http://e"], api_keys=KEYS,
                     tenant_caps={"typo": {"max_priority": 1}})
    with pytest.raises(ValueError, match="max_priority"):
        RouterConfig(mode="affinity", engine=["http://e"], api_keys=KEYS,
                     tenant_caps={"trusted": {"max_priority": 11}})


# -- through the router ----------------------------------------------------------------------------


def test_without_configuration_no_tenant_orders_its_leases_above_anothers() -> None:
    """A tenant's clients ask for the top priority on every turn and hint: the engine's lease,
    the router's session and the renewal between turns all get priority 0, as the other
    tenant's; and in the router's full session table, the other tenant's session is no
    longer the one pushed out."""

    async def main() -> None:
        engine = StandIn()
        started = affinity_router([engine], engine_leases=True, api_keys=KEYS, max_sessions=2)
        async with started as (router, url), httpx.AsyncClient(timeout=30) as client:
            async def turn(tenant: str, session: str, **hints: Any) -> None:
                reply = await client.post(f"{url}/v1/chat/completions",
                                          json=chat(session, **hints), headers=auth(tenant))
                assert reply.status_code == 200, reply.text

            await turn("greedy", "g1", priority=10)
            assert leases(engine)[-1].priority == 0
            view = await client.get(f"{url}/v1/turnkv/sessions/g1", headers=auth("greedy"))
            assert view.json()["priority"] == 0
            reply = await client.post(f"{url}/v1/turnkv/sessions/g1/hints",
                                      json={"priority": 10, "next_turn_in": 30},
                                      headers=auth("greedy"))
            assert reply.status_code == 200 and reply.json()["priority"] == 0, reply.text
            for _ in range(1000):
                if any(lease.renew_only for lease in leases(engine)):
                    break
                await asyncio.sleep(0.01)
            [renewal] = [lease for lease in leases(engine) if lease.renew_only]
            assert renewal.priority == 0
            # The table holds two sessions: the third pushes out the least recently used,
            # not the other tenant's for its lower priority.
            await turn("other", "o1")
            await turn("greedy", "g2", priority=10)
            assert router.sessions.table.evicted_total == 1
            mine = await client.get(f"{url}/v1/turnkv/sessions/o1", headers=auth("other"))
            assert mine.status_code == 200, mine.text

    asyncio.run(main())


def test_an_operators_caps_hold_each_tenant_to_its_own() -> None:
    """A trusted tenant may ask for up to its cap; everyone's announced return is held to
    the floor, but the trusted tenant's own, which is lower."""

    async def main() -> None:
        engine = StandIn()
        started = affinity_router(
            [engine], engine_leases=True, api_keys=KEYS, min_next_turn_in=20.0,
            tenant_caps={"trusted": {"max_priority": 5, "min_next_turn_in": 1.0}})
        async with started as (_, url), httpx.AsyncClient(timeout=30) as client:
            sent = [("trusted", {"priority": 7, "next_turn_in": 0}, (5, 1.0)),
                    ("trusted", {"priority": 3, "next_turn_in": 8}, (3, 8.0)),
                    ("greedy", {"priority": 7, "next_turn_in": 0}, (0, 20.0)),
                    ("other", {"priority": -2, "next_turn_in": 45}, (-2, 45.0))]
            for i, (tenant, hints, (priority, next_turn_in)) in enumerate(sent):
                reply = await client.post(f"{url}/v1/chat/completions",
                                          json=chat(f"s{i}", **hints), headers=auth(tenant))
                assert reply.status_code == 200, reply.text
                lease = leases(engine)[-1]
                assert (lease.priority, lease.next_turn_in_s) == (priority, next_turn_in)

    asyncio.run(main())
