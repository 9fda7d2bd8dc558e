"""Session records: what goes to Redis and back, on a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import redis_server
from turnkv_server.router.session_store import RedisStore, StoreUnavailable, apply_record, to_record
from turnkv_server.router.sessions import Session, SessionKey


def session(key: SessionKey) -> Session:
    s = Session(key=key, created_at=0.0, last_used=0.0, expires_at=10.0)
    s.prefill, s.decode, s.prefix_id, s.priority = "prefill-0", "decode-1", "p-1", 2
    s.tokens, s.turns = [1, 2, 3], 4
    s.totals.turns, s.totals.prefill_computed = 4, 300
    s.mode_state.model = "m"
    return s


def test_a_sessions_mode_state_is_a_typed_record() -> None:
    """What the modes keep of a session is a record of typed fields, one per thing kept (the
    model its turns name, a push back in flight, bidirectional's offer of held KV), not a dict
    of string keys."""
    from turnkv_server.router.sessions import ModeState

    state = Session(key=SessionKey("tenant", "s"), created_at=0.0, last_used=0.0,
                    expires_at=1.0).mode_state
    assert isinstance(state, ModeState)
    assert (state.model, state.push_back, state.held_kv) == (None, None, None)


def test_a_record_carries_what_the_next_turn_needs_and_no_local_object() -> None:
    key = SessionKey("tenant", "s1")
    source = session(key)
    task_like = object()  # a push back in flight: this process's alone
    source.mode_state.push_back = task_like  # type: ignore[assignment]
    record = to_record(source)
    assert record["mode_state"] == {"model": "m"}

    target = Session(key=key, created_at=5.0, last_used=5.0, expires_at=9.0)
    target.mode_state.push_back = task_like  # type: ignore[assignment]
    target.mode_state.model = "stale"
    apply_record(target, record)
    assert (target.prefill, target.decode, target.prefix_id, target.priority) == (
        "prefill-0", "decode-1", "p-1", 2)
    assert (target.tokens, target.turns) == ([1, 2, 3], 4)
    assert vars(target.totals) == vars(source.totals)
    assert target.mode_state.model == "m"  # the record's, over the stale local value
    assert target.mode_state.push_back is task_like


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def test_redis_store_round_trip_expiry_and_shared_secret(redis_url: str) -> None:
    async def run() -> None:
        first, second = RedisStore(redis_url), RedisStore(redis_url)
        try:
            secret = await first.start()
            assert await second.start() == secret and len(secret) == 32
            key = SessionKey("tenant", "s1")
            await first.save(key, to_record(session(key)), ttl_s=0.3)
            record = await second.load(key)
            assert record is not None and record["tokens"] == [1, 2, 3]
            # Another tenant's session of the same ID is another record.
            assert await second.load(SessionKey("other", "s1")) is None
            await asyncio.sleep(0.5)
            assert await second.load(key) is None  # Redis expired it with the lease
            await first.save(key, to_record(session(key)), ttl_s=30)
            await second.delete(key)
            assert await first.load(key) is None
        finally:
            await first.close()
            await second.close()

    asyncio.run(run())


def test_an_unreachable_redis_degrades_to_local_sessions(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        pass  # started and stopped: nothing listens there now

    async def run() -> None:
        store = RedisStore(url)
        key = SessionKey("tenant", "s1")
        await store.save(key, to_record(session(key)), ttl_s=30)  # logged, not raised
        with pytest.raises(StoreUnavailable):  # unknown, not "no such session"
            await store.load(key)
        await store.close()

    asyncio.run(run())


def test_a_record_keeps_the_sessions_epoch() -> None:
    """Every router serving the session tells the engines the same life of it."""
    key = SessionKey("tenant", "s1")
    source = session(key)
    target = Session(key=key, created_at=5.0, last_used=5.0, expires_at=9.0)
    assert target.epoch != source.epoch
    apply_record(target, to_record(source))
    assert target.epoch == source.epoch
