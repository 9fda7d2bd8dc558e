"""What the router reads of an engine's settings, through its HTTP API (`engines`): its KV
cache's block size and capacity, from its `/metrics` (the health probe reads them once an engine
answers; the `bidirectional` mode reads the block size).
"""

from __future__ import annotations

from turnkv_server.engine.metrics import CacheConfig, parse_cache_config
from turnkv_server.router.engines import Engine, Upstream


async def block_size(upstream: Upstream, engine: Engine) -> int:
    """The engine's KV block size, from its `/metrics`."""
    size = (await cache_config(upstream, engine)).block_size
    if size is None:
        raise RuntimeError(f"{engine.name} does not report its block size")
    return size


async def cache_config(upstream: Upstream, engine: Engine) -> CacheConfig:
    """The engine's KV cache settings (block size, blocks), from its `/metrics`."""
    reply = await upstream.get(engine, "/metrics", timeout=10.0)
    return parse_cache_config(reply.content.decode())
