"""The fleet simulator held to cases computed by hand: one engine and one session, a full
cache evicting in its policy's order, a lost engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from turnkv_server.connector.leases import LeaseLimits
from turnkv_server.sim.fleet import Fleet, FleetSpec
from turnkv_server.sim.kv_cache import SessionKvCache
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.sessions import SimSession, SimTurn
from turnkv_server.sim.turnkv_routing import TurnkvRouting

BLOCK = 16
# Leases may pin the whole cache: with the connector's default cap (half of it), pinning b
# would end a's lease first, and the order under test would not decide.
UNCAPPED = LeaseLimits(max_pinned_fraction=1.0)


def costs(capacity: int = 100_000) -> ServiceCosts:
    # Prefill: 10 ms + 1 ms per computed token; a decode step: 20 ms + 1 ms per sequence.
    return ServiceCosts("hand", prefill_fixed_ms=10.0, prefill_ms_per_token=1.0,
                        prefill_ms_per_token_per_kctx=0.0, decode_fixed_ms=20.0,
                        decode_ms_per_seq=1.0, transfer_tokens_per_ms=100.0,
                        tier_tokens_per_ms=100.0, kv_capacity_tokens=capacity,
                        block_size=BLOCK, kv_bytes_per_token=1)


def session(sid: str, *turns: tuple[int, int, float], start_s: float = 0.0) -> SimSession:
    return SimSession(sid, tuple(SimTurn(*t) for t in turns), start_s=start_s)


def test_one_engine_one_session_computes_the_prompt_then_only_the_delta() -> None:
    run = Fleet(FleetSpec("affinity", 1, costs())).run(
        [session("a", (1000, 11, 0.0), (200, 11, 1.0))])
    first, second = run.outcomes
    assert first.computed == 1000
    assert first.ttft_ms == pytest.approx(10 + 1000)
    # 10 steps after the first token, a batch of one: 21 ms each.
    assert first.decode_ms == pytest.approx(10 * 21)
    # Turn 2's prompt: 1000 + 11 + 200 = 1211 tokens; the cache holds 1011 as 63 whole
    # blocks (1008 tokens), so 203 are computed.
    assert second.prompt == 1211
    assert second.cached == 1008
    assert second.computed == 203
    assert second.ttft_ms == pytest.approx(10 + 203)


def test_a_prompt_reaching_a_decoding_engine_waits_for_the_step_in_progress() -> None:
    # a decodes from 1.010 s at 21 ms a step (boundaries at 1.094, 1.115, 1.136 s...). b's
    # prompt arrives at 1.100 s, in a step: vLLM schedules it when that step ends (1.115 s),
    # and computes its 90 tokens (100 ms) in the next: its first token at 1.215 s.
    run = Fleet(FleetSpec("affinity", 1, costs())).run(
        [session("a", (1000, 11, 0.0)), session("b", (90, 2, 0.0), start_s=1.1)])
    by_session = {o.session: o for o in run.outcomes}
    assert by_session["a"].ttft_ms == pytest.approx(1010)
    assert by_session["b"].ttft_ms == pytest.approx(15 + 100)
    assert by_session["b"].waited_ms == pytest.approx(15)
    # a's decode: 5 steps of 21 ms, one of 100 (b's prefill in it), one of 22 (b's one
    # decode step beside it), 3 of 21.
    assert by_session["a"].decode_ms == pytest.approx(5 * 21 + 100 + 22 + 3 * 21)


@pytest.mark.parametrize(("tier_tokens", "wait_ms"), [
    # As above, with the fitted wait beyond the step in progress: on an engine without a
    # tier 1 step more (15 + 21 ms), on one with a tier 2 (15 + 2 x 21 ms).
    (0, 15 + 21),
    (4096, 15 + 2 * 21),
])
def test_a_prompt_reaching_a_decoding_engine_waits_the_fitted_steps_beyond(
        tier_tokens: int, wait_ms: float) -> None:
    fitted = replace(costs(), join_wait_steps=1.0, tier_join_wait_steps=2.0)
    run = Fleet(FleetSpec("affinity", 1, fitted, tier_tokens=tier_tokens)).run(
        [session("a", (1000, 11, 0.0)), session("b", (90, 2, 0.0), start_s=1.1)])
    b = next(o for o in run.outcomes if o.session == "b")
    assert b.waited_ms == pytest.approx(wait_ms)
    assert b.ttft_ms == pytest.approx(wait_ms + 100)


def test_turnkv_pair_serves_one_session_whole_on_its_idle_home() -> None:
    run = Fleet(FleetSpec("turnkv", 2, costs())).run(
        [session("a", (1000, 11, 0.0), (200, 11, 1.0))])
    assert [o.where for o in run.outcomes] == ["whole", "whole"]
    assert run.outcomes[1].computed == 203
    assert run.outcomes[1].ttft_ms == pytest.approx(10 + 203)


def _cache(order: str) -> tuple[SessionKvCache, list[float]]:
    now = [0.0]
    return SessionKvCache(3 * 160, BLOCK, order, lambda: now[0], UNCAPPED), now  # type: ignore[arg-type]


@pytest.mark.parametrize(("order", "evicted"), [("lru", "a"), ("lease", "b")])
def test_a_full_cache_evicts_in_its_policys_order(order: str, evicted: str) -> None:
    """a ends first and is back in 5 s; b ends later and is back in 100 s. Room for c takes a
    under LRU (least recent), b under turnkv's leases (expected back last)."""
    cache, now = _cache(order)
    for sid, at, back in (("a", 1.0, 5.0), ("b", 2.0, 100.0)):
        now[0] = at
        cache.begin(sid)
        assert cache.reserve(sid, 160)
        cache.end(sid, 160, next_turn_in_s=back)
    now[0] = 3.0
    cache.begin("c")
    assert cache.reserve("c", 320)  # a third block of room is free: one session must go
    assert cache.held(evicted) == 0
    assert {cache.held(s) for s in {"a", "b"} - {evicted}} == {160}


@pytest.mark.parametrize("order", ["lru", "lease"])
def test_a_shared_prefix_is_cached_once(order: str) -> None:
    """Three sessions of 160 tokens, the first 64 of each a shared system prompt: 352 distinct
    tokens, which the 480-token cache holds without evicting any."""
    cache, _ = _cache(order)
    for sid in ("a", "b", "c"):
        cache.share(sid, "system", 64)
        cache.begin(sid)
        assert cache.reserve(sid, 160)
        cache.end(sid, 160, next_turn_in_s=5.0)
    cache.begin("d")
    assert cache.reserve("d", 128)
    assert [cache.held(s) for s in ("a", "b", "c")] == [160, 160, 160]


@pytest.mark.parametrize(("order", "a_computes"), [("lru", 320), ("lease", 144)])
def test_the_hit_rate_of_a_full_cache_follows_the_eviction_order(order: str,
                                                                  a_computes: int) -> None:
    """Room for 480 tokens: a and b hold 176 each (160 + 16 output), then c needs 304 (288 +
    16): 176 must go. Under LRU a's history goes, and a's second turn (prompt 160 + 16 + 144
    = 320) recomputes it all; under leases b's goes (back in 100 s, a in 10 s), and a
    computes only 320 - 176 = 144."""
    sessions = [
        session("a", (160, 16, 0.0), (144, 16, 10.0)),
        session("b", (160, 16, 0.0), (16, 16, 100.0), start_s=2.0),
        session("c", (288, 16, 0.0), start_s=5.0),
    ]
    spec = FleetSpec("affinity", 1, costs(480), eviction=order,  # type: ignore[arg-type]
                     lease_limits=UNCAPPED)
    run = Fleet(spec).run(sessions)
    by = {(o.session, o.turn): o for o in run.outcomes}
    assert by[("a", 1)].computed == a_computes
    # b's second turn aside (what it finds depends on c's history since): prompts of
    # 160 + 160 + 288 + 320 = 928 tokens, of which the cache saved 320 - a_computes.
    counted = [o for o in run.outcomes if (o.session, o.turn) != ("b", 1)]
    hit_rate = 1 - sum(o.computed for o in counted) / sum(o.prompt for o in counted)
    assert hit_rate == pytest.approx((320 - a_computes) / 928)


@pytest.mark.parametrize("routing", ["affinity", "turnkv"])
def test_a_lost_engines_sessions_recompute_elsewhere(routing: str) -> None:
    """The history is gone with engine-0, and the pair's other engine holds no copy: under
    turnkv too, whose router reads no prompt on an idle home and so pushes no copy back after
    it (`TurnkvRouting._decide`). The second turn computes all of its 1,211 tokens there."""
    spec = FleetSpec(routing, 2, costs(), lose=((0, 5.0),))  # type: ignore[arg-type]
    run = Fleet(spec).run([session("a", (1000, 11, 0.0), (200, 11, 10.0))])
    first, second = run.outcomes
    assert first.home == "engine-0"
    assert second.home == "engine-1"
    assert second.computed == 1211
    assert second.ttft_ms == pytest.approx(10 + 1211)


def test_admission_holds_a_new_session_while_the_live_ones_fill_the_budget() -> None:
    """After a's first turn a holds 1,011 tokens; b, new at 5 s, would double that past a
    1,500-token budget (`router.admission.fits`), so it waits for a to end (its second turn
    at 10 s onward); without a budget it starts at 5 s."""
    sessions = [session("a", (1000, 11, 0.0), (200, 11, 10.0)),
                session("b", (500, 11, 0.0), start_s=5.0)]
    free = Fleet(FleetSpec("affinity", 1, costs())).run(sessions)
    held = Fleet(FleetSpec("affinity", 1, costs(), admission_tokens=1500)).run(sessions)
    b_free = next(o for o in free.outcomes if o.session == "b")
    b_held = next(o for o in held.outcomes if o.session == "b")
    a_last = next(o for o in held.outcomes if (o.session, o.turn) == ("a", 1))
    assert b_free.arrived_s == pytest.approx(5.0)
    assert b_held.arrived_s == pytest.approx(
        a_last.arrived_s + (a_last.ttft_ms + a_last.decode_ms) / 1000)
    assert held.traffic.admission_waits == 1


@pytest.mark.parametrize("routing", ["affinity", "standard", "turnkv"])
def test_a_routings_overhead_is_added_to_each_of_its_turns_ttft(routing: str) -> None:
    plain = costs()
    slower = replace(plain, routing_overhead_ms={routing: 40.0, "other": 500.0})
    sessions = [session("a", (1000, 11, 0.0), (200, 11, 1.0))]
    before = Fleet(FleetSpec(routing, 2, plain)).run(sessions).outcomes
    after = Fleet(FleetSpec(routing, 2, slower)).run(sessions).outcomes
    assert [o.ttft_ms - b.ttft_ms for o, b in zip(after, before, strict=True)] == \
        pytest.approx([40.0, 40.0])


def test_the_turnkv_planner_sees_the_room_the_sessions_histories_leave() -> None:
    # The router shows the planner each engine's cache less what the sessions' histories
    # hold there (`Holdings.room`: 90% of the cache is the leases' share); without it every
    # engine looks empty to the planner, and it splits, moves and copies into full caches.
    fleet = Fleet(FleetSpec("turnkv", 2, costs(capacity=10_000)))
    routing = fleet.routing
    assert isinstance(routing, TurnkvRouting)
    a = session("a", (1000, 11, 0.0), (200, 11, 5.0))
    fleet.env.process(routing.serve(a, 0))
    fleet.env.run()
    home = routing.places["a"].home
    other = routing.partner[home.name]
    assert routing.load(home).room_tokens == 9_000 - 1011
    # An idle home's turn is not read, and pushes no copy back: the other engine's room is
    # whole (as the router counts it, `planned.py`).
    assert other.cache.held("a") == 0
    assert routing.load(other).room_tokens == 9_000


def test_a_read_turns_copy_counts_on_the_other_engine() -> None:
    """b decodes on engine-1 until about 8.5 s, c (from 2 s) on engine-0, a's home, until
    about 11 s. a's second turn comes at 9 s: its home busy, the other engine idle, so the
    router reads it; it is served whole (the other engine holds none of a's history: a split
    would compute all of it there) and its history pushed back to engine-1, where the planner
    then counts the copy: 9,000 tokens for leases, less a's 1,222 and b's 500, on each."""
    fleet = Fleet(FleetSpec("turnkv", 2, costs(capacity=10_000)))
    routing = fleet.routing
    assert isinstance(routing, TurnkvRouting)
    sessions = [session("a", (1000, 11, 0.0), (200, 11, 7.8), (50, 11, 30.0)),
                session("b", (100, 400, 0.0), (100, 5, 30.0)),
                session("c", (100, 400, 0.0), (100, 5, 30.0), start_s=2.0)]
    for s in sessions:
        fleet.env.process(fleet._session(s))  # the fleet's own loop, stopped mid-way
    fleet.env.run(until=12.0)
    second = next(o for o in fleet.outcomes if (o.session, o.turn) == ("a", 1))
    assert (second.where, second.home) == ("whole", "engine-0")
    home = routing.places["a"].home
    other = routing.partner[home.name]
    assert other.cache.held("a") == 1216  # 1,222 tokens, in whole blocks
    assert routing.load(home).room_tokens == 9_000 - 1222 - 500
    assert routing.load(other).room_tokens == 9_000 - 1222 - 500


def test_a_tiers_stores_lengthen_the_steps_that_copy_them_a_block_a_step() -> None:
    # A tier below the cache, each block (16 tokens) copied to it 5 ms on the engine's step.
    # Turn 1 computes 1,000 tokens (1,010 ms: nothing waits to be stored yet); its 62 whole
    # blocks then wait, and each of its 10 decode steps copies one: 21 + 5 ms a step. Its end
    # writes the output's whole block too: 52 + 1 wait. Idle, the engine copies them on,
    # 5 ms each: 20 in the 100 ms before turn 2, whose prefill step copies one more (10 + 203
    # + 5 ms); its 12 new blocks join the 32 left, and its 10 steps copy one each.
    stores = replace(costs(), tier_store_ms_per_block=5.0)
    run = Fleet(FleetSpec("affinity", 1, stores, tier_tokens=4096)).run(
        [session("a", (1000, 11, 0.0), (200, 11, 0.1))])
    first, second = run.outcomes
    assert first.ttft_ms == pytest.approx(1010)
    assert first.decode_ms == pytest.approx(10 * (21 + 5))
    assert (second.computed, second.from_tier) == (203, 0)
    assert second.ttft_ms == pytest.approx(10 + 203 + 5)
    assert second.waited_ms == pytest.approx(0)
    assert second.decode_ms == pytest.approx(10 * (21 + 5))
    assert run.engines[0].stores_waiting == pytest.approx(32 + 12 + 1 - 10)


def test_a_pairs_shared_tier_serves_a_lost_engines_history_to_the_other() -> None:
    """With a shared tier nothing is pushed back: the other engine's cache holds nothing of
    a after its first turn, but the tier both engines write holds its 1,011 tokens (1,008 in
    whole blocks) and outlives engine-0. The second turn, on engine-1, reads those 1,008 at
    100 tokens a ms and computes 1,211 - 1,008 = 203."""
    spec = FleetSpec("turnkv", 2, costs(), shared_tier=True, lose=((0, 5.0),))
    fleet = Fleet(spec)
    run = fleet.run([session("a", (1000, 11, 0.0), (200, 11, 10.0))])
    first, second = run.outcomes
    engine_0, engine_1 = fleet.engines
    assert engine_0.shared is engine_1.shared is not None
    assert first.home == "engine-0"
    assert second.home == "engine-1"
    assert (second.cached, second.from_tier, second.computed) == (0, 1008, 203)
    assert second.ttft_ms == pytest.approx(10 + 203 + 1008 / 100)


def test_a_shared_tier_stands_in_for_the_push_back() -> None:
    fleet = Fleet(FleetSpec("turnkv", 2, costs(), shared_tier=True))
    run = fleet.run([session("a", (1000, 11, 0.0), (200, 11, 5.0))])
    assert [o.where for o in run.outcomes] == ["whole", "whole"]
    home = fleet.engines[0] if run.outcomes[0].home == "engine-0" else fleet.engines[1]
    other = fleet.engines[1] if home is fleet.engines[0] else fleet.engines[0]
    assert "a" not in other.cache  # no copy made: the tier holds the history
    # The second turn's 1,211 + 11 tokens, in whole blocks.
    assert home.shared is not None and home.shared.held("a") == 1216
