"""Holds on vLLM's real block pool: references taken and given back, free blocks restored."""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool

from turnkv_server.connector.holds import BlockHolder
from turnkv_server.connector.leases import LeaseLimits, LeaseTable
from turnkv_server.connector.session_epochs import ReleasedSessions

BLOCKS = 32


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(fraction: float = 1.0) -> tuple[BlockPool, BlockHolder, Clock]:
    pool = BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=16)
    clock = Clock()
    leases = LeaseTable(BLOCKS, LeaseLimits(max_pinned_fraction=fraction), clock)
    return pool, BlockHolder(pool, leases), clock


def finish_request(pool: BlockPool, holder: BlockHolder, session: str, n: int,
                   shared: list[int] = ()) -> list[int]:
    """A request that used `shared` blocks plus `n` new ones ends; the session holds them."""
    pool.touch([pool.blocks[i] for i in shared])
    new = [b.block_id for b in pool.get_new_blocks(n)]
    ids = list(shared) + new
    holder.hold(session, ids)
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])  # the request's own references
    return ids


def test_held_blocks_stay_allocated_and_come_back_on_release() -> None:
    pool, holder, _ = setup()
    start = pool.get_num_free_blocks()
    ids = finish_request(pool, holder, "s", 4)
    assert pool.get_num_free_blocks() == start - 4
    assert all(pool.blocks[i].ref_cnt == 1 for i in ids)
    assert holder.release("s", "final") == 4
    assert pool.get_num_free_blocks() == start


def test_the_next_turn_keeps_shared_blocks_alive() -> None:
    pool, holder, _ = setup()
    start = pool.get_num_free_blocks()
    first = finish_request(pool, holder, "s", 3)
    second = finish_request(pool, holder, "s", 2, shared=first)
    assert pool.get_num_free_blocks() == start - 5
    assert all(pool.blocks[i].ref_cnt == 1 for i in second)
    holder.release("s")
    assert pool.get_num_free_blocks() == start


def test_expiry_and_pressure_free_blocks_without_leaks() -> None:
    pool, holder, clock = setup()
    start = pool.get_num_free_blocks()
    finish_request(pool, holder, "old", 10)
    clock.now += 1
    finish_request(pool, holder, "new", 10)
    # A request needs 15 blocks: only the least recently used hold has to go.
    free_before = pool.get_num_free_blocks()
    assert holder.make_room(free_before + 5) == 10
    assert "old" not in holder.leases and "new" in holder.leases
    clock.now += 10_000
    assert holder.expire() == 10
    assert pool.get_num_free_blocks() == start
    assert holder.freed_total == 20


def test_the_null_block_is_never_held() -> None:
    pool, holder, _ = setup()
    assert pool.blocks[0].is_null
    new = [b.block_id for b in pool.get_new_blocks(2)]
    assert holder.hold("s", [0, *new]) == 2


def test_make_room_counts_only_blocks_that_return_to_the_pool() -> None:
    pool, holder, clock = setup()
    # "old" holds 5 blocks that a running request also uses (it hit them); "new" 5 of its own.
    shared = finish_request(pool, holder, "old", 5)
    pool.touch([pool.blocks[i] for i in shared])  # the running request's references
    clock.now += 1
    finish_request(pool, holder, "new", 5)
    running = pool.get_new_blocks(pool.get_num_free_blocks())  # and every other block
    assert pool.get_num_free_blocks() == 0
    # Releasing "old" gives nothing back: "new" has to go too for 3 blocks to be free.
    holder.make_room(3)
    assert pool.get_num_free_blocks() == 5
    assert len(holder.leases) == 0
    assert all(pool.blocks[i].ref_cnt == 1 for i in shared)  # still the running request's
    pool.free_blocks(running)


def test_release_all_gives_every_block_back() -> None:
    pool, holder, _ = setup()
    start = pool.get_num_free_blocks()
    first = finish_request(pool, holder, "a", 3)
    finish_request(pool, holder, "b", 2, shared=first[:2])
    assert holder.release_all("reset") == 7
    assert pool.get_num_free_blocks() == start and len(holder.leases) == 0


def test_a_released_life_is_remembered_until_the_longest_lease_has_passed() -> None:
    """The holder remembers which lives of a session were released, on the lease table's
    clock, for the operator's longest lease; then forgets them (a bounded table)."""
    pool, holder, clock = setup()
    finish_request(pool, holder, "s", 3)
    holder.release("s", epoch=5)
    assert not holder.current("s", 5) and not holder.current("s", 4)
    assert holder.current("s", 6) and holder.current("s", None)
    holder.release("s", epoch=3)  # a late release of an earlier life ends nothing new
    assert not holder.current("s", 5)
    clock.now += holder.leases.policy.max_ttl_s + 1
    assert holder.current("s", 5)
    assert len(holder.released) == 0


def test_released_lives_past_the_table_size_are_forgotten_oldest_first() -> None:
    released = ReleasedSessions(lambda: 0.0, memory_s=60.0, max_entries=2)
    for n, session in enumerate(("a", "b", "c")):
        released.record(session, n)
    assert len(released) == 2
    assert not released.ended("a", 0)
    assert released.ended("b", 1) and released.ended("c", 2)
