"""Where the Responses API's stored responses live: in Redis where routers share it (`--redis`),
so that `previous_response_id` resolves on any router and survives a router's restart; else in
this router's memory.

Each tenant's responses are bounded by count, bytes and age (`ResponsesBounds`): past the
count or the bytes, the tenant's oldest go first (one tenant's responses never push out
another's), and each lasts `max_age_s` at most. A response is stored once, when it is served,
and never changed, so oldest-first is creation order. A record is opaque bytes here (its
contents are `apis.responses_state`'s), keyed by tenant and response ID: one tenant cannot read
or delete another's, and in Redis neither appears in the keyspace, only a hash of both.

What each tenant holds (`usage`: records and bytes) is in the router's `/metrics`
(`ResponsesGauges`): this router's memory exactly, or in Redis what the last store or delete
of this router found there (other routers change it too).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from turnkv_server.router.config import RouterConfig
from turnkv_server.router.session_store import PREFIX, StoreUnavailable

__all__ = ["MemoryResponses", "RedisResponses", "ResponseStore", "ResponsesBounds",
           "ResponsesGauges", "StoreUnavailable", "responses_store"]


@dataclass(frozen=True)
class ResponsesBounds:
    """Per tenant."""

    max_count: int = 10_000
    max_bytes: int = 256 * 1024 * 1024
    max_age_s: float = 24 * 3600.0

    @classmethod
    def of(cls, config: RouterConfig) -> ResponsesBounds:
        return cls(config.responses_max_count, config.responses_max_bytes,
                   config.responses_ttl)


class ResponseStore(Protocol):
    bounds: ResponsesBounds

    async def put(self, tenant: str, response_id: str, record: bytes) -> bool:
        """Store a record; False if it alone is over the tenant's bytes (it is not stored).
        Raises `StoreUnavailable`."""

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        """The record; None if there is none (never stored, deleted, pushed out, or expired).
        Raises `StoreUnavailable`."""

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Whether there was one to delete. Raises `StoreUnavailable`."""

    async def close(self) -> None: ...

    def usage(self) -> dict[str, tuple[int, int]]:
        """Each tenant's stored records and their bytes, as far as this router knows."""


class MemoryResponses:
    """This router's own: per tenant, records in creation order."""

    def __init__(self, bounds: ResponsesBounds, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.bounds = bounds
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}

    async def put(self, tenant: str, response_id: str, record: bytes) -> bool:
        if len(record) > self.bounds.max_bytes:
            return False
        self._drop(tenant, response_id)
        records = self._tenants.setdefault(tenant, OrderedDict())
        records[response_id] = (self._clock(), record)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(record)
        self._expire(tenant)
        while len(records) > self.bounds.max_count \
                or self._bytes[tenant] > self.bounds.max_bytes:
            self._drop(tenant, next(iter(records)))
        return True

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        self._expire(tenant)
        records = self._tenants.get(tenant)
        found = records.get(response_id) if records is not None else None
        return None if found is None else found[1]

    async def delete(self, tenant: str, response_id: str) -> bool:
        self._expire(tenant)
        return self._drop(tenant, response_id)

    async def close(self) -> None:
        return None

    def count(self, tenant: str) -> int:
        return len(self._tenants.get(tenant) or ())

    def size(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def usage(self) -> dict[str, tuple[int, int]]:
        for tenant in list(self._tenants):
            self._expire(tenant)
        return {tenant: (self.count(tenant), self.size(tenant)) for tenant in self._tenants}

    def _expire(self, tenant: str) -> None:
        records = self._tenants.get(tenant)
        oldest = self._clock() - self.bounds.max_age_s
        while records and next(iter(records.values()))[0] <= oldest:
            self._drop(tenant, next(iter(records)))

    def _drop(self, tenant: str, response_id: str) -> bool:
        records = self._tenants.get(tenant)
        found = records.pop(response_id, None) if records is not None else None
        if found is None:
            return False
        self._bytes[tenant] -= len(found[1])
        if not records:
            del self._tenants[tenant], self._bytes[tenant]
        return True


# Redis: a tenant's records each under their own key (expiring by themselves), with an index
# of them by creation time and their sizes, so that the bounds hold across routers. Each
# change is one script: atomic whichever routers store at once.
_DROP = """
local function drop(m)
  local size = tonumber(redis.call('HGET', KEYS[3], m) or '0')
  redis.call('HDEL', KEYS[3], m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('DECRBY', KEYS[4], size)
  redis.call('DEL', ARGV[1] .. m)
end
local function expire(now, age)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - age)) do drop(m) end
end
"""
# KEYS: the record, the tenant's index, its sizes, its bytes. ARGV: the records' key prefix,
# the member, the record, now (ms), the age bound (ms), the count bound, the bytes bound.
_PUT = _DROP + """
local now, age = tonumber(ARGV[4]), tonumber(ARGV[5])
expire(now, age)
if redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then drop(ARGV[2]) end
local size = string.len(ARGV[3])
redis.call('SET', KEYS[1], ARGV[3], 'PX', age)
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], size)
local total = redis.call('INCRBY', KEYS[4], size)
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[6]) or total > tonumber(ARGV[7]) do
  drop(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
  total = tonumber(redis.call('GET', KEYS[4]))
end
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], age) end
return {redis.call('ZCARD', KEYS[2]), total}
"""
# KEYS as _PUT's. ARGV: the records' key prefix, the member, now (ms), the age bound (ms).
_DELETE = _DROP + """
expire(tonumber(ARGV[3]), tonumber(ARGV[4]))
local found = redis.call('HEXISTS', KEYS[3], ARGV[2])
if found == 1 then drop(ARGV[2]) end
return {found, redis.call('ZCARD', KEYS[2]), tonumber(redis.call('GET', KEYS[4]) or '0')}
"""


class RedisResponses:
    """Shared by the routers of one Redis server."""

    def __init__(self, url: str, bounds: ResponsesBounds,
                 clock: Callable[[], float] = time.time) -> None:
        self.bounds = bounds
        self._clock = clock
        self._redis = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)
        self._usage: dict[str, tuple[int, int]] = {}

    async def put(self, tenant: str, response_id: str, record: bytes) -> bool:
        if len(record) > self.bounds.max_bytes:
            return False
        keys, member = _keys(tenant, response_id)
        count, size = await self._run(self._put, keys, [
            _RECORDS, member, record, self._now_ms(), self._age_ms(), self.bounds.max_count,
            self.bounds.max_bytes])
        self._usage[tenant] = (int(count), int(size))
        return True

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        keys, _ = _keys(tenant, response_id)
        try:
            found = await self._redis.get(keys[0])
        except RedisError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return found if isinstance(found, bytes) else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        keys, member = _keys(tenant, response_id)
        found, count, size = await self._run(self._delete, keys, [
            _RECORDS, member, self._now_ms(), self._age_ms()])
        self._usage[tenant] = (int(count), int(size))
        return bool(found)

    async def close(self) -> None:
        await self._redis.aclose()

    def usage(self) -> dict[str, tuple[int, int]]:
        return dict(self._usage)

    async def _run(self, script: object, keys: list[str], args: list[object]) -> list[int]:
        """A script's answer: a list of integers (Redis's, from Lua's numbers)."""
        try:
            return [int(x) for x in await script(keys=keys, args=args)]  # type: ignore[operator]
        except RedisError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _age_ms(self) -> int:
        return max(1, int(self.bounds.max_age_s * 1000))


_RECORDS = f"{PREFIX}response:"


def _keys(tenant: str, response_id: str) -> tuple[list[str], str]:
    """(the record's key, the tenant's index, sizes and bytes), and the record's member in
    them: hashes, no tenant names or response IDs."""
    member = hashlib.sha256(f"{tenant}\0{response_id}".encode()).hexdigest()[:40]
    scope = f"{PREFIX}responses:{hashlib.sha256(tenant.encode()).hexdigest()[:40]}"
    return [f"{_RECORDS}{member}", f"{scope}:index", f"{scope}:sizes", f"{scope}:bytes"], member


class ResponsesGauges(Collector):
    """`turnkv_responses_stored` and `turnkv_responses_bytes`, per tenant, read from the store
    whenever the metrics are."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stored = GaugeMetricFamily("turnkv_responses_stored", "Responses API responses (and "
                                   "conversations) stored, per tenant", labels=["tenant"])
        size = GaugeMetricFamily("turnkv_responses_bytes", "Bytes of the Responses API "
                                 "records stored, per tenant", labels=["tenant"])
        for tenant, (count, total) in sorted(self.store.usage().items()):
            stored.add_metric([tenant], count)
            size.add_metric([tenant], total)
        yield stored
        yield size


def responses_store(config: RouterConfig) -> MemoryResponses | RedisResponses:
    """The router's store: Redis's with `--redis`, else its memory's."""
    bounds = ResponsesBounds.of(config)
    if config.redis_url:
        return RedisResponses(config.redis_url, bounds)
    return MemoryResponses(bounds)
