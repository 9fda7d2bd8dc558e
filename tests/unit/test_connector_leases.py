"""The engine-side lease table: TTL rules, renewal, release, expiry, the pin cap, pressure."""

from __future__ import annotations

import math

import pytest

from turnkv_server.connector.leases import LeaseLimits, LeaseTable


class Clock:
    """The table's only clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(total: int = 100, fraction: float = 0.5, **policy: float) -> tuple[LeaseTable, Clock]:
    clock = Clock()
    return LeaseTable(total, LeaseLimits(max_pinned_fraction=fraction, **policy), clock), clock


def test_clients_may_only_shorten_the_operator_cap() -> None:
    policy = LeaseLimits(default_ttl_s=60, max_ttl_s=120)
    assert policy.ttl(None) == 60
    assert policy.ttl(10) == 10
    assert policy.ttl(10_000) == 120
    with pytest.raises(ValueError):
        policy.ttl(0)
    for bad in (dict(default_ttl_s=200, max_ttl_s=100), dict(max_pinned_fraction=0.0),
                dict(max_pinned_fraction=1.5)):
        with pytest.raises(ValueError):
            LeaseLimits(**bad)


def test_a_new_turn_replaces_the_lease_and_frees_the_old_references() -> None:
    leases, _ = table()
    assert leases.pin("s", [1, 2, 3]).blocks == []
    # Turn 2 keeps blocks 1-3 (touched again by the caller) and adds 4-5.
    released = leases.pin("s", [1, 2, 3, 4, 5])
    assert released.blocks == [3, 2, 1]
    assert leases.get("s").blocks == (1, 2, 3, 4, 5)
    assert leases.pinned_blocks == 5


def test_renewal_extends_a_live_lease_only() -> None:
    leases, clock = table(default_ttl_s=60, max_ttl_s=600)
    leases.pin("s", [1], ttl_s=30)
    clock.now += 20
    assert leases.renew("s", ttl_s=100, priority=3)
    lease = leases.get("s")
    assert lease.expires_at == clock.now + 100 and lease.priority == 3
    clock.now += 101
    assert not leases.renew("s")  # expired: the next turn must not count on it
    assert not leases.renew("other")


def test_expiry_is_lazy_and_returns_every_block() -> None:
    leases, clock = table()
    leases.pin("a", [1, 2], ttl_s=10)
    leases.pin("b", [3], ttl_s=100)
    clock.now += 50
    assert "a" in leases  # nothing happens until someone asks
    gone = leases.expire()
    assert [lease.session_id for lease in gone.leases] == ["a"] and gone.blocks == [2, 1]
    assert "a" not in leases and leases.pinned_blocks == 1
    assert leases.released_total["expired"] == 1


def test_release_ends_a_lease_once() -> None:
    leases, _ = table()
    leases.pin("s", [7, 8])
    assert leases.release("s", "final").blocks == [8, 7]
    assert leases.release("s").blocks == []
    assert len(leases) == 0 and leases.pinned_blocks == 0


def test_a_release_of_an_earlier_life_leaves_a_later_lives_lease() -> None:
    leases, _ = table()
    leases.pin("s", [7, 8], epoch=6)
    assert leases.renew("s", ttl_s=30)
    assert leases.release("s", epoch=5).blocks == []  # renewed, still life 6's
    assert leases.release("s", epoch=6).blocks == [8, 7]
    leases.pin("s", [7], epoch=None)
    assert leases.release("s", epoch=5).blocks == [7]  # a lease of no known life: ended


def test_shared_blocks_count_once_against_the_cap() -> None:
    leases, _ = table(total=10, fraction=0.5)  # cap: 5 blocks
    leases.pin("a", [0, 1, 2, 3])  # a shared head of 3 blocks and one of its own
    leases.pin("b", [0, 1, 2, 4])
    assert leases.pinned_blocks == 5 and len(leases) == 2
    # Releasing a frees only its references: the shared head stays held by b.
    assert leases.release("a").blocks == [3, 2, 1, 0]
    assert leases.pinned_blocks == 4


def test_over_the_cap_the_lowest_priority_then_least_recent_go_first() -> None:
    leases, clock = table(total=10, fraction=0.6)  # cap: 6 blocks
    leases.pin("low-old", [1, 2], priority=0)
    clock.now += 1
    leases.pin("high", [3, 4], priority=5)
    clock.now += 1
    leases.pin("low-new", [5, 6], priority=0)
    clock.now += 1
    released = leases.pin("newest", [7, 8], priority=0)
    assert [lease.session_id for lease in released.leases] == ["low-old"]
    assert leases.pinned_blocks == 6 <= leases.cap_blocks
    assert leases.released_total["over_cap"] == 1


def test_a_lease_bigger_than_the_cap_is_not_kept() -> None:
    leases, _ = table(total=10, fraction=0.3)  # cap: 3 blocks
    leases.pin("small", [1])
    released = leases.pin("huge", [2, 3, 4, 5])
    assert [lease.session_id for lease in released.leases] == ["huge"]
    assert released.blocks == [5, 4, 3, 2]
    assert "huge" not in leases and "small" in leases


def test_eviction_takes_the_lowest_priority_then_least_recent_and_spares_keep() -> None:
    leases, clock = table(total=20, fraction=1.0)
    for sid, priority in (("a", 0), ("b", 0), ("c", 0), ("vip", 1)):
        leases.pin(sid, [len(leases)], priority=priority)
        clock.now += 1
    leases.renew("a")  # a's next turn came: now the most recent of the priority-0 leases
    order = []
    while (gone := leases.evict(keep=["c"])).leases:
        order.append(gone.leases[0].session_id)
    assert order == ["b", "a", "vip"]  # c, the request being admitted, is spared
    assert list(leases) == ["c"] and leases.released_total["pressure"] == 3
    leases.renew("c", priority=-1)
    assert leases.evict().leases[0].session_id == "c"
    assert leases.evict().leases == ()


def test_the_next_deadline_follows_pins_renewals_and_releases() -> None:
    leases, clock = table(default_ttl_s=100, max_ttl_s=1000)
    assert leases.next_expiry() == math.inf and not leases.due()
    leases.pin("a", [1], ttl_s=10)
    leases.pin("b", [2], ttl_s=20)
    assert leases.next_expiry() == clock.now + 10
    leases.renew("a", ttl_s=50)
    assert leases.next_expiry() == clock.now + 20
    leases.release("b")
    assert leases.next_expiry() == clock.now + 50
    clock.now += 50
    assert leases.due()
    assert [lease.session_id for lease in leases.expire().leases] == ["a"]
    assert leases.next_expiry() == math.inf and not leases.due()


def test_release_all_ends_every_lease() -> None:
    leases, _ = table()
    leases.pin("a", [1, 2])
    leases.pin("b", [2, 3])
    assert sorted(leases.release_all("reset").blocks) == [1, 2, 2, 3]
    assert len(leases) == 0 and leases.pinned_blocks == 0 and leases.next_expiry() == math.inf


class Priority(int):
    """A priority that counts how often the table compares it: what picking a victim costs."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        Priority.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_picking_victims_is_logarithmic_not_a_scan() -> None:
    n = 2000
    leases, clock = table(total=10 * n, fraction=1.0)
    for i in range(n):
        leases.pin(f"s{i}", [i], priority=Priority(0))
        clock.now += 1
    Priority.compared = 0
    order = [leases.evict().leases[0].session_id for _ in range(n)]
    assert order == [f"s{i}" for i in range(n)]
    # A scan compares every remaining lease per victim (n * n / 2 = 2,000,000 here); a heap
    # about 2 log2(n) per victim.
    assert Priority.compared < 30 * n * math.log2(n) / 2


# -- hints: the session expected back last goes first ----------------------------------------

def victims(leases: LeaseTable, keep: tuple[str, ...] = ()) -> list[str]:
    """Every lease but `keep`, in the order evictions end them."""
    order = []
    while (gone := leases.evict(keep=keep)).leases:
        order.append(gone.leases[0].session_id)
    return order


def test_the_session_back_last_goes_first_whatever_the_lru_order() -> None:
    leases, clock = table(total=20, fraction=1.0)
    leases.pin("back-in-2s", [1], next_turn_in_s=2)  # the least recently used
    clock.now += 1
    leases.pin("back-in-60s", [2], next_turn_in_s=60)
    clock.now += 1
    leases.pin("back-in-10s", [3], next_turn_in_s=10)
    assert leases.get("back-in-60s").expected_back == 1001 + 60
    assert victims(leases) == ["back-in-60s", "back-in-10s", "back-in-2s"]
    assert leases.released_total["pressure"] == 3


def test_over_the_cap_the_session_back_last_goes_and_the_new_lease_stays() -> None:
    leases, clock = table(total=10, fraction=0.4)  # cap: 4 blocks
    leases.pin("soon", [1, 2], next_turn_in_s=2)
    clock.now += 1
    leases.pin("later", [3, 4], next_turn_in_s=60)
    clock.now += 1
    # The newest is back even later, but it is the one being pinned.
    released = leases.pin("newest", [5, 6], next_turn_in_s=300)
    assert [lease.session_id for lease in released.leases] == ["later"]
    assert sorted(leases) == ["newest", "soon"]


def test_an_unhinted_lease_counts_as_back_at_its_deadline() -> None:
    leases, clock = table(total=20, fraction=1.0, default_ttl_s=100, max_ttl_s=1000)
    leases.pin("plain-old", [1], ttl_s=30)  # deadline 1030
    clock.now += 1
    leases.pin("plain-new", [2], ttl_s=500)  # deadline 1501
    clock.now += 1
    leases.pin("back-at-1202", [3], next_turn_in_s=200)
    leases.pin("back-at-1012", [4], next_turn_in_s=10)
    # The un-hinted candidate is the least recently used (plain-old, deadline 1030), set
    # against the hinted one back last (1202): the hinted one goes. Then plain-old (1030)
    # against 1012: plain-old. Then plain-new (1501) against 1012: plain-new.
    assert victims(leases) == ["back-at-1202", "plain-old", "plain-new", "back-at-1012"]


def test_a_tie_between_a_deadline_and_a_return_goes_by_priority_then_to_the_unhinted() -> None:
    leases, clock = table(total=20, fraction=1.0, default_ttl_s=100, max_ttl_s=1000)
    leases.pin("plain", [1], ttl_s=50, priority=1)  # deadline 1050
    leases.pin("hinted", [2], next_turn_in_s=50, priority=0)  # back at 1050
    assert victims(leases) == ["hinted", "plain"]
    leases.pin("plain", [1], ttl_s=50)
    leases.pin("hinted", [2], next_turn_in_s=50)
    assert victims(leases) == ["plain", "hinted"]  # "at or after": the un-hinted goes


def test_priority_breaks_ties_between_equal_returns_then_least_recent_use() -> None:
    leases, clock = table(total=20, fraction=1.0)
    leases.pin("low-old", [1], next_turn_in_s=30, priority=0)  # all back at 1030
    clock.now += 10
    leases.pin("high", [2], next_turn_in_s=20, priority=3)
    clock.now += 10
    leases.pin("low-new", [3], next_turn_in_s=10, priority=0)
    assert victims(leases) == ["low-old", "low-new", "high"]
    # A return expected later still goes before a lower priority: the hint comes first.
    leases.pin("vip", [1], next_turn_in_s=100, priority=10)
    leases.pin("cheap", [2], next_turn_in_s=5, priority=-10)
    assert victims(leases) == ["vip", "cheap"]


def test_without_hints_eviction_is_exactly_lru_within_priority() -> None:
    # Equal TTLs: by deadline, the most recently used would go first. It must not.
    leases, clock = table(total=50, fraction=1.0)
    for i in range(10):
        leases.pin(f"s{i}", [i], priority=1 if i % 3 == 0 else 0)
        clock.now += 1
    leases.renew("s4")
    assert victims(leases) == ["s1", "s2", "s5", "s7", "s8", "s4", "s0", "s3", "s6", "s9"]


def test_renewal_updates_the_expected_return_and_can_drop_it() -> None:
    leases, clock = table(total=20, fraction=1.0)
    leases.pin("a", [1], next_turn_in_s=5)
    leases.pin("b", [2], next_turn_in_s=60)
    clock.now += 1
    assert leases.renew("b", next_turn_in_s=0)  # b's turn came: it is back now
    assert leases.get("b").expected_back == clock.now
    assert victims(leases, keep=()) == ["a", "b"]
    leases.pin("a", [1], next_turn_in_s=5)
    leases.pin("b", [2], next_turn_in_s=60)
    assert leases.renew("b")  # no hint this time: back to today's order, at its deadline
    assert leases.get("b").expected_back is None
    assert victims(leases) == ["b", "a"]
    leases.pin("a", [1], next_turn_in_s=5)
    with pytest.raises(ValueError):
        leases.pin("a", [1, 2], next_turn_in_s=-1)
    with pytest.raises(ValueError):
        leases.renew("a", next_turn_in_s=math.nan)
    assert leases.get("a").blocks == (1,)  # a refused hint leaves the lease as it was


def test_hinted_leases_spare_keep_and_expire_on_their_deadline() -> None:
    leases, clock = table(total=20, fraction=1.0, default_ttl_s=100, max_ttl_s=1000)
    leases.pin("admitted", [1], next_turn_in_s=600)
    leases.pin("other", [2], next_turn_in_s=1)
    assert victims(leases, keep=("admitted",)) == ["other"]
    # A return announced past the TTL changes nothing about when the lease ends.
    assert leases.next_expiry() == clock.now + 100
    clock.now += 100
    assert [lease.session_id for lease in leases.expire().leases] == ["admitted"]


def test_switching_between_hinted_and_unhinted_keeps_the_heaps_bounded() -> None:
    n = 50
    leases, clock = table(total=10 * n, fraction=1.0)
    for i in range(n):
        leases.pin(f"s{i}", [i])
    for round_ in range(200):
        clock.now += 1
        for i in range(n):
            leases.renew(f"s{i}", next_turn_in_s=None if (round_ + i) % 2 else i)
    heaps = (leases._by_deadline, leases._by_value, leases._by_return)  # type: ignore[attr-defined]
    assert all(len(heap) <= 2 * n + 65 for heap in heaps)
    # Last round (199): odd i hinted (back at now + i), even i un-hinted (deadline now + 300):
    # those go first, in renewal order (all used at once), then the hinted, back last first.
    odd = [f"s{i}" for i in range(n - 1, 0, -2)]
    even = [f"s{i}" for i in range(0, n, 2)]
    assert victims(leases) == even + odd


def test_picking_hinted_victims_is_logarithmic_not_a_scan() -> None:
    n = 2000
    leases, clock = table(total=10 * n, fraction=1.0, default_ttl_s=10 * n, max_ttl_s=10 * n)
    for i in range(n):
        # Everyone back at the same moment, so each comparison in the hinted heap reaches the
        # priority; every other lease is un-hinted, set against the hinted top per victim.
        if i % 2:
            leases.pin(f"s{i}", [i], priority=Priority(0), next_turn_in_s=5 * n - i)
        else:
            leases.pin(f"s{i}", [i], priority=Priority(0))
        clock.now += 1
    Priority.compared = 0
    order = [leases.evict().leases[0].session_id for _ in range(n)]
    # Un-hinted deadlines (1000 + 10 n and later) are after the hinted return (1000 + 5 n):
    # they go first, least recent first, then the hinted ones, all back at once, least recent
    # first.
    assert order == [f"s{i}" for i in range(0, n, 2)] + [f"s{i}" for i in range(1, n, 2)]
    assert Priority.compared < 30 * n * math.log2(n) / 2
