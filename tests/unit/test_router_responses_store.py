"""The Responses API's stored responses: bounded by count, bytes and age per tenant, scoped by
tenant, in this router's memory and, shared, on a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.redis_server import redis_server
from turnkv_server.router.responses_store import (
    MemoryResponses,
    RedisResponses,
    ResponsesBounds,
    ResponsesGauges,
    StoreUnavailable,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


Store: TypeAlias = MemoryResponses | RedisResponses
# A store of the kind named, with the bounds given and the test's clock.
MakeStore = Callable[[ResponsesBounds, Clock], Store]


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStore]:
    if request.param == "memory":
        yield lambda bounds, clock: MemoryResponses(bounds, clock)
        return
    with redis_server(tmp_path) as url:
        yield lambda bounds, clock: RedisResponses(url, bounds, clock)


def run(store: Store, steps: Callable[[Store], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        try:
            return await steps(store)
        finally:
            await store.close()
    return asyncio.run(go())


def test_get_and_delete_are_scoped_by_tenant(make_store: MakeStore) -> None:
    async def steps(store: Store) -> None:
        assert await store.put("acme", "resp_1", b"acme's")
        assert await store.put("globex", "resp_1", b"globex's")
        assert await store.get("acme", "resp_1") == b"acme's"
        assert await store.get("globex", "resp_1") == b"globex's"
        assert await store.get("initech", "resp_1") is None
        assert not await store.delete("initech", "resp_1")
        assert await store.delete("acme", "resp_1")
        assert await store.get("acme", "resp_1") is None
        assert not await store.delete("acme", "resp_1")  # gone already
        assert await store.get("globex", "resp_1") == b"globex's"
    run(make_store(ResponsesBounds(), Clock()), steps)


def test_past_the_count_a_tenants_oldest_go_first_and_only_its_own(make_store: MakeStore
                                                                   ) -> None:
    clock = Clock()

    async def steps(store: Store) -> None:
        await store.put("globex", "resp_g", b"g")
        for n in range(4):
            clock.now += 1
            await store.put("acme", f"resp_{n}", b"x")
        assert [await store.get("acme", f"resp_{n}") for n in range(4)] == [
            None, b"x", b"x", b"x"]
        assert await store.get("globex", "resp_g") == b"g"
    run(make_store(ResponsesBounds(max_count=3), clock), steps)


def test_past_the_bytes_a_tenants_oldest_go_first(make_store: MakeStore) -> None:
    clock = Clock()

    async def steps(store: Store) -> None:
        for n in range(3):
            clock.now += 1
            assert await store.put("acme", f"resp_{n}", b"x" * 40)
        # 120 bytes over 100: the oldest goes; the two left hold 80.
        assert await store.get("acme", "resp_0") is None
        assert await store.get("acme", "resp_1") == b"x" * 40
        clock.now += 1
        assert await store.put("acme", "resp_big", b"y" * 90)  # pushes out both others
        assert await store.get("acme", "resp_1") is None
        assert await store.get("acme", "resp_2") is None
        assert await store.get("acme", "resp_big") == b"y" * 90
        # A record over the bound alone is not stored, and pushes nothing out.
        assert not await store.put("acme", "resp_huge", b"z" * 101)
        assert await store.get("acme", "resp_huge") is None
        assert await store.get("acme", "resp_big") == b"y" * 90
    run(make_store(ResponsesBounds(max_bytes=100), clock), steps)


def test_a_deleted_record_gives_its_bytes_back(make_store: MakeStore) -> None:
    async def steps(store: Store) -> None:
        await store.put("acme", "resp_a", b"a" * 60)
        assert await store.delete("acme", "resp_a")
        assert await store.put("acme", "resp_b", b"b" * 60)
        assert await store.put("acme", "resp_c", b"c" * 40)
        assert await store.get("acme", "resp_b") == b"b" * 60  # 100 bytes: within the bound
    run(make_store(ResponsesBounds(max_bytes=100), Clock()), steps)


def test_a_record_stored_again_replaces_itself(make_store: MakeStore) -> None:
    async def steps(store: Store) -> None:
        await store.put("acme", "resp_a", b"a" * 60)
        await store.put("acme", "resp_a", b"A" * 60)
        await store.put("acme", "resp_b", b"b" * 40)
        assert await store.get("acme", "resp_a") == b"A" * 60
    run(make_store(ResponsesBounds(max_bytes=100, max_count=2), Clock()), steps)


def test_usage_says_what_each_tenant_holds(make_store: MakeStore) -> None:
    """What `/metrics` reports (`ResponsesGauges`): each tenant's records and bytes, after
    stores past the bounds and deletes."""
    clock = Clock()

    async def steps(store: Store) -> None:
        for n in range(4):
            clock.now += 1
            await store.put("acme", f"resp_{n}", b"x" * 30)
        await store.put("globex", "resp_g", b"g" * 7)
        assert store.usage() == {"acme": (3, 90), "globex": (1, 7)}
        assert await store.delete("acme", "resp_3")
        assert store.usage()["acme"] == (2, 60)
        metrics = {(m.name, s.labels["tenant"]): s.value
                   for m in ResponsesGauges(store).collect() for s in m.samples}
        assert metrics == {("turnkv_responses_stored", "acme"): 2,
                           ("turnkv_responses_stored", "globex"): 1,
                           ("turnkv_responses_bytes", "acme"): 60,
                           ("turnkv_responses_bytes", "globex"): 7}
    run(make_store(ResponsesBounds(max_count=3, max_bytes=100), clock), steps)


def test_memory_records_expire_with_age() -> None:
    clock = Clock()

    async def steps(store: Store) -> None:
        assert isinstance(store, MemoryResponses)
        await store.put("acme", "resp_old", b"o")
        clock.now += 30
        await store.put("acme", "resp_new", b"n")
        clock.now += 31  # the first is 61 s old
        assert await store.get("acme", "resp_old") is None
        assert await store.get("acme", "resp_new") == b"n"
        assert (store.count("acme"), store.size("acme")) == (1, 1)
        clock.now += 30
        assert await store.get("acme", "resp_new") is None
        assert (store.count("acme"), store.size("acme")) == (0, 0)
    run(MemoryResponses(ResponsesBounds(max_age_s=60), clock), steps)


def test_redis_records_expire_with_age_and_routers_share_them(redis_url: str) -> None:
    async def steps() -> None:
        bounds = ResponsesBounds(max_age_s=0.3, max_count=2)
        first, second = RedisResponses(redis_url, bounds), RedisResponses(redis_url, bounds)
        try:
            await first.put("acme", "resp_a", b"a")
            assert await second.get("acme", "resp_a") == b"a"
            # The count bound holds across routers: the second's two push out the first's.
            await second.put("acme", "resp_b", b"b")
            await second.put("acme", "resp_c", b"c")
            assert await first.get("acme", "resp_a") is None
            await asyncio.sleep(0.5)
            assert await first.get("acme", "resp_b") is None
            # What expired is out of the bounds' count too: two fit again.
            await first.put("acme", "resp_d", b"d")
            await first.put("acme", "resp_e", b"e")
            assert await second.get("acme", "resp_d") == b"d"
        finally:
            await first.close()
            await second.close()
    asyncio.run(steps())


def test_an_unreachable_redis_is_said_so() -> None:
    async def steps() -> None:
        store = RedisResponses("unix:///nonexistent/redis.sock?db=0", ResponsesBounds())
        try:
            with pytest.raises(StoreUnavailable):
                await store.get("acme", "resp_a")
            with pytest.raises(StoreUnavailable):
                await store.put("acme", "resp_a", b"a")
        finally:
            await store.close()
    asyncio.run(steps())


# Any mix of stores, deletes and time passing, over two tenants: after each step, each
# tenant's records stay within the count and the bytes, and none older than the age comes
# back.
OPS = st.lists(st.tuples(
    st.sampled_from(["put", "put", "put", "delete", "wait"]), st.sampled_from(["acme", "globex"]),
    st.integers(0, 7), st.integers(1, 60), st.floats(0, 40)), max_size=40)
BOUNDS = ResponsesBounds(max_count=4, max_bytes=120, max_age_s=60)


async def check_bounds(store: Store, clock: Clock, ops: list[tuple[str, str, int, int, float]]
                       ) -> None:
    stored: dict[tuple[str, str], float] = {}  # what was stored last, and when
    for op, tenant, n, size, wait in ops:
        key = (tenant, f"resp_{n}")
        if op == "put":
            clock.now += 0.001
            assert await store.put(tenant, key[1], b"x" * size)
            stored[key] = clock.now
        elif op == "delete":
            await store.delete(tenant, key[1])
            stored.pop(key, None)
        else:
            clock.now += wait
        for who in ("acme", "globex"):
            found = {}
            for key in [k for k in stored if k[0] == who]:
                record = await store.get(*key)
                if record is not None:
                    found[key] = record
            assert len(found) <= BOUNDS.max_count
            assert sum(map(len, found.values())) <= BOUNDS.max_bytes
            count, size = store.usage().get(who, (0, 0))
            assert count <= BOUNDS.max_count and size <= BOUNDS.max_bytes
            assert all(clock.now - stored[k] < BOUNDS.max_age_s for k in found)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_any_sequence_keeps_memory_within_its_bounds(ops: list[Any]) -> None:
    clock = Clock()
    asyncio.run(check_bounds(MemoryResponses(BOUNDS, clock), clock, ops))


def test_any_sequence_keeps_redis_within_its_bounds(redis_url: str) -> None:
    """(Its records' own expiry is Redis's clock, not the test's: the age bound is the index's
    here, which the test's clock drives; a record past it is out of the index, and of the
    count.)"""
    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=OPS)
    def run_ops(ops: list[Any]) -> None:
        async def steps() -> None:
            redis.Redis.from_url(redis_url).flushdb()
            clock = Clock()
            store = RedisResponses(redis_url, BOUNDS, clock)
            try:
                await check_bounds(store, clock, [op for op in ops if op[0] != "wait"])
            finally:
                await store.close()
        asyncio.run(steps())

    run_ops()
