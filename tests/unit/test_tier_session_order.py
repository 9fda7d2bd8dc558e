"""The host tier's eviction order by the sessions' hints (`turnkv_server.tier.session_order`),
on vLLM's own chunk statuses and request contexts, and loaded through vLLM's policy factory."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from turnkv_server.tier.session_order import DEFAULT_TTL_S, SessionOrderPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(name: str) -> OffloadKey:
    return OffloadKey(name.encode())


def request(**turnkv: Any) -> ReqContext:
    return ReqContext(req_id="r", kv_transfer_params={"turnkv": turnkv} if turnkv else None)


def filled(names: list[str], clock: Clock) -> SessionOrderPolicy:
    """A policy holding `names`, stored in that order, each ready and idle."""
    policy = SessionOrderPolicy(len(names), clock=clock)
    for i, name in enumerate(names):
        chunk = ChunkStatus(i)
        policy.insert(key(name), chunk)
        chunk.ref_cnt = 0
        policy.mark_evictable(key(name))
    return policy


def victims(policy: SessionOrderPolicy, n: int, protected: frozenset[str] = frozenset()
            ) -> list[str] | None:
    out = policy.evict(n, {key(p) for p in protected})
    return None if out is None else [k.decode() for k, _ in out]


def use(policy: SessionOrderPolicy, names: list[str], context: ReqContext) -> None:
    policy.on_request_finished(((*[key(n) for n in names],),), set(), set(), context)


def test_without_hints_it_is_least_recently_used() -> None:
    clock = Clock()
    policy = filled(["a", "b", "c", "d"], clock)
    use(policy, ["a"], request(session="s1"))
    assert victims(policy, 2) == ["b", "c"]
    assert victims(policy, 2) == ["d", "a"]
    assert victims(policy, 1) is None


def test_the_session_expected_back_last_goes_first_and_soon_back_stays() -> None:
    clock = Clock()
    policy = filled(["soon", "late", "plain"], clock)
    use(policy, ["soon"], request(session="s1", next_turn_in_s=2.0))
    use(policy, ["late"], request(session="s2", next_turn_in_s=60.0))
    # `plain` has no hint: expected back at its horizon (DEFAULT_TTL_S after its use), later
    # than either hinted session, so it goes first; then the one back in a minute.
    assert victims(policy, 1) == ["plain"]
    assert victims(policy, 1) == ["late"]
    assert victims(policy, 1) == ["soon"]


def test_a_hint_beyond_the_horizon_goes_before_an_unhinted_chunk() -> None:
    clock = Clock()
    policy = filled(["plain", "far"], clock)
    use(policy, ["far"], request(session="s", next_turn_in_s=DEFAULT_TTL_S * 2))
    assert victims(policy, 1) == ["far"]


def test_a_released_session_goes_first_and_priority_breaks_ties() -> None:
    clock = Clock()
    policy = filled(["done", "low", "high"], clock)
    use(policy, ["low"], request(session="a", next_turn_in_s=5.0, priority=-1))
    use(policy, ["high"], request(session="b", next_turn_in_s=5.0, priority=3))
    use(policy, ["done"], request(session="c", release=True))
    assert victims(policy, 1) == ["done"]
    assert victims(policy, 1) == ["low"]


def test_a_later_turn_re_times_its_chunks() -> None:
    clock = Clock()
    policy = filled(["x", "y"], clock)
    use(policy, ["x"], request(session="s", next_turn_in_s=DEFAULT_TTL_S * 3))
    use(policy, ["x"], request(session="s", next_turn_in_s=1.0))  # now back soon
    assert victims(policy, 1) == ["y"]


def test_protected_and_pinned_chunks_are_skipped_and_a_failed_eviction_changes_nothing(
) -> None:
    clock = Clock()
    policy = filled(["a", "b", "c"], clock)
    policy.mark_non_evictable(key("a"))  # a load reads it
    assert victims(policy, 3) is None
    assert victims(policy, 2, protected=frozenset({"b", "c"})) is None
    assert set(policy.chunks) == {key("a"), key("b"), key("c")}
    assert victims(policy, 1, protected=frozenset({"b"})) == ["c"]
    policy.mark_evictable(key("a"))
    assert victims(policy, 2) == ["a", "b"]
    assert policy.chunks == {}


def test_stale_entries_are_compacted() -> None:
    clock = Clock()
    policy = filled([f"k{i}" for i in range(8)], clock)
    for _ in range(200):
        use(policy, [f"k{i}" for i in range(8)], request(session="s", next_turn_in_s=1.0))
    heaps = len(policy._released) + len(policy._unhinted) + len(policy._hinted)
    assert heaps <= max(64, 3 * 8)
    assert victims(policy, 8) is not None


def test_bad_params_count_as_unhinted() -> None:
    clock = Clock()
    policy = filled(["a", "b"], clock)
    use(policy, ["a"], ReqContext(req_id="r", kv_transfer_params={"turnkv": "nonsense"}))
    assert victims(policy, 1) == ["b"]


def test_evicting_nothing() -> None:
    assert victims(filled(["a"], Clock()), 0) == []


def test_vllm_loads_it_by_module_path() -> None:
    cls = CachePolicyFactory.get_cache_policy_cls(
        "SessionOrderPolicy", "turnkv_server.tier.session_order")
    assert cls is SessionOrderPolicy
