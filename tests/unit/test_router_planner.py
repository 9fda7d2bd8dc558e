"""The planner (`router.planner`, with its weighing, `router.weighing`) and its cost model:
where a turn runs and what moves, from what the turns measured."""

from __future__ import annotations

import dataclasses

import pytest

from turnkv_server.router.decisions import Priors, TurnFacts
from turnkv_server.router.planner import (
    SPLIT_MEMORY_TURNS,
    CostModel,
    EngineLoad,
    Ewma,
    TurnsInFlight,
    batch_bucket,
    context_bucket,
    tokens_to_compute,
)

# The planner the modes run: the decision, with its weighing of placements.
from turnkv_server.router.weighing import WeighingPlanner as Planner

HOME, HELPER = "decode-0", "prefill-0"


def measured(home_ms: float = 1.0, helper_ms: float = 1.0, context: int = 4096) -> CostModel:
    """Both engines measured at the given prefill cost per token."""
    costs = CostModel()
    costs.observe_prefill(HOME, context, 1000, home_ms * 1000)
    costs.observe_prefill(HELPER, context, 1000, helper_ms * 1000)
    return costs


def history_turn(prompt: int = 4096, delta: int = 2000, helper_holds: int | None = None,
                 **more: object) -> TurnFacts:
    """A turn adding `delta` tokens to a history the home holds (and the helper too, unless
    `helper_holds` says otherwise)."""
    held = prompt - delta
    return TurnFacts(prompt_tokens=prompt, home_holds=held,
                     helper_holds=held if helper_holds is None else helper_holds,
                     block_size=16, expected_output=100, **more)  # type: ignore[arg-type]


def decoding(home_batch: int, home_ms: float, helper_batch: int, helper_ms: float
             ) -> CostModel:
    """`measured()`, and each engine measured five times decoding 100 tokens in `*_ms` at a
    batch of `*_batch`."""
    costs = measured()
    for _ in range(5):
        costs.observe_decode(HOME, home_batch, first_token_ms=0.0, total_ms=home_ms,
                             completion_tokens=100)
        costs.observe_decode(HELPER, helper_batch, first_token_ms=0.0, total_ms=helper_ms,
                             completion_tokens=100)
    return costs


def long_answer_turn() -> TurnFacts:
    """A long answer on a history the home holds and the helper does not: where decoding
    costs most, so a move is worth its recompute."""
    return TurnFacts(prompt_tokens=1000, home_holds=990, helper_holds=0, block_size=16,
                     expected_output=500)


# -- the cost model ------------------------------------------------------------------------

def test_buckets_are_powers_of_two() -> None:
    assert [context_bucket(n) for n in (1, 256, 257, 5000)] == [256, 256, 512, 8192]
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 9)] == [1, 1, 2, 4, 16]


def test_ewma_follows_new_measurements_and_answers_for_the_nearest_bucket() -> None:
    mean = Ewma(weight=0.5)
    assert mean.nearest(512) is None
    mean.add(512, 1.0)
    mean.add(512, 3.0)
    assert mean.nearest(512) == 2.0
    mean.add(8192, 10.0)
    # 1024 is nearer 512 than 8192 on a log scale; 4096 nearer 8192.
    assert mean.nearest(1024) == 2.0 and mean.nearest(4096) == 10.0


def test_cost_model_uses_its_priors_until_an_engine_measures() -> None:
    costs = CostModel(Priors(prefill_ms_per_token=0.5, decode_step_ms=20.0,
                             transfer_tokens_per_ms=10.0))
    assert costs.prefill_ms_per_token(HOME, 1000) == (0.5, False)
    assert costs.decode_step_ms(HOME, 4) == 20.0 and costs.transfer_ms(100) == 10.0
    costs.observe_prefill(HOME, 1000, computed=200, engine_ms=100.0)
    assert costs.prefill_ms_per_token(HOME, 1000) == (0.5, True)
    costs.observe_prefill(HOME, 1000, computed=200, engine_ms=400.0)
    assert costs.prefill_ms_per_token(HOME, 1000)[0] == pytest.approx(0.5 + 0.2 * 1.5)
    assert costs.measured(HOME) and not costs.measured(HELPER)
    costs.observe_decode(HOME, batch=3, first_token_ms=100.0, total_ms=190.0,
                         completion_tokens=10)
    assert costs.decode_step_ms(HOME, 4) == 10.0


def test_cost_model_ignores_what_teaches_nothing() -> None:
    costs = CostModel()
    costs.observe_prefill(HOME, 1000, computed=None, engine_ms=10.0)
    costs.observe_prefill(HOME, 1000, computed=200, engine_ms=None)
    # A few tokens are mostly a step's fixed cost.
    costs.observe_prefill(HOME, 1000, computed=3, engine_ms=30.0)
    costs.observe_decode(HOME, 1, first_token_ms=None, total_ms=10.0, completion_tokens=5)
    costs.observe_decode(HOME, 1, first_token_ms=5.0, total_ms=10.0, completion_tokens=1)
    assert not costs.measured(HOME)
    assert costs.decode_step_ms(HOME, 1) == costs.priors.decode_step_ms


def test_cost_model_counts_a_tier_read_apart_from_the_computation() -> None:
    """An engine's timing of a prompt it partly read from its tier is the computation's (at the
    cost per token its other prompts measured) and the read's: the rest, per token read."""
    costs = CostModel(Priors(tier_read_tokens_per_ms=40.0))
    assert costs.tier_read_ms(HOME, 400) == 10.0  # the prior
    # Before the engine measured its computing, a read's share is not known: nothing learned.
    costs.observe_prefill(HOME, 4096, computed=200, engine_ms=500.0, restored=2000)
    assert not costs.measured(HOME) and costs.tier_read_ms(HOME, 400) == 10.0
    costs.observe_prefill(HOME, 4096, computed=1000, engine_ms=500.0)  # 0.5 ms a token
    costs.observe_prefill(HOME, 4096, computed=200, engine_ms=500.0, restored=2000)
    # 100 ms of computing, 400 ms of reading 2,000 tokens; the cost per token is untouched.
    assert costs.tier_read_ms(HOME, 1000) == pytest.approx(200.0)
    assert costs.prefill_ms_per_token(HOME, 4096) == (0.5, True)
    assert costs.tier_read_ms(HELPER, 400) == 10.0


def test_a_prompt_that_shared_its_engine_only_lowers_what_it_is_believed_to_cost() -> None:
    """A prompt sent while its engine had another unanswered may be timed with the other's
    steps (a run's first prompts, two to an engine at once: 153 tokens timed 6,870 ms, 45 ms a
    token against 4.5). Its figures are upper bounds: below the mean they teach, above it they
    are left, and before any they teach nothing."""
    costs = CostModel()
    costs.observe_prefill(HOME, 2000, computed=150, engine_ms=6750.0, shared=True)
    costs.observe_prefill(HOME, 2000, computed=150, engine_ms=675.0, shared=True,
                          restored=1800)
    assert not costs.measured(HOME) and costs.prompt_ms(HOME) == 0.0
    costs.observe_prefill(HOME, 2000, computed=1000, engine_ms=4500.0)  # 4.5 ms a token
    costs.observe_prefill(HOME, 2000, computed=150, engine_ms=6750.0, shared=True)
    assert costs.prefill_ms_per_token(HOME, 2000) == (4.5, True)
    assert costs.prompt_ms(HOME) == 4500.0
    costs.observe_prefill(HOME, 2000, computed=1000, engine_ms=4000.0, shared=True)
    assert costs.prefill_ms_per_token(HOME, 2000)[0] == pytest.approx(4.5 - 0.2 * 0.5)
    # Alone, a dearer prompt raises it as before.
    costs.observe_prefill(HOME, 2000, computed=1000, engine_ms=9000.0)
    assert costs.prefill_ms_per_token(HOME, 2000)[0] > 4.5
    # A tier read is an upper bound too: a read shared with another prompt's steps is left.
    costs.observe_prefill(HOME, 2000, computed=200, engine_ms=3000.0, restored=1800,
                          shared=True)
    assert costs.tier_read_ms(HOME, 1800) == 1800 / costs.priors.tier_read_tokens_per_ms


def test_turns_in_flight_say_whether_a_turns_prompt_shared_its_engine() -> None:
    turns = TurnsInFlight()
    turns.begin("a", HOME, 1000, HOME, 100.0, 0.0)
    turns.begin("b", HOME, 1000, HOME, 100.0, 0.0, shared=True)
    assert turns.end("b") and not turns.end("a") and not turns.end("a")


def test_cost_model_learns_a_splits_tail_beyond_the_transfer() -> None:
    costs = CostModel(Priors(transfer_tokens_per_ms=50.0, split_overhead_ms=5.0))
    costs.observe_split_tail(HOME, tail_ms=90.0, received=500)  # 10 ms of it the transfer
    assert costs.split_overhead_ms(HOME) == 80.0
    assert costs.split_overhead_ms(HELPER) == 5.0
    costs.observe_split_tail(HOME, tail_ms=-1.0, received=0)  # not measured
    assert costs.split_overhead_ms(HOME) == 80.0
    # A home that still computed 300 ms of prompts when the helper answered: not the split's.
    costs.observe_split_tail(HOME, tail_ms=390.0, received=500, ahead_ms=300.0)
    assert costs.split_overhead_ms(HOME) == 80.0


def test_a_tier_read_measured_slow_keeps_a_turn_whole() -> None:
    """A busy home, an idle helper that would read the history from the shared tier: at the
    prior's read rate the split pays; once reads measured five times slower, it does not."""
    home, helper = EngineLoad(HOME, in_flight=2), EngineLoad(HELPER)
    facts = TurnFacts(prompt_tokens=4096, home_holds=3896, helper_holds=0, block_size=16,
                      expected_output=100, shared_tier=True, tier_holds=3896)
    costs = measured()
    assert Planner(costs).decide(home, helper, facts).where == "split"
    for _ in range(20):
        costs.observe_prefill(HELPER, 4096, computed=200, engine_ms=200.0 + 0.2 * 3888,
                              restored=3888)
    decision = Planner(costs).decide(home, helper, facts)
    assert decision.where == "whole", decision.why


def test_tokens_to_compute_counts_whole_blocks_and_the_last_token() -> None:
    assert tokens_to_compute(100, held=100, block=16) == 4  # 96 held in whole blocks
    assert tokens_to_compute(100, held=0, block=16) == 100
    assert tokens_to_compute(100, held=100, block=None) == 1


# -- decisions -----------------------------------------------------------------------------

def test_idle_home_serves_whole_without_the_prompt() -> None:
    planner = Planner(measured())
    home, helper = EngineLoad(HOME), EngineLoad(HELPER)
    facts = TurnFacts(expected_output=100)
    assert not planner.needs_prompt(home, helper, facts)
    decision = planner.decide(home, helper, facts)
    assert (decision.where, decision.home, decision.prefill) == ("whole", HOME, HOME)
    assert not decision.push_back and "nothing in flight" in decision.why


def test_busy_home_asks_for_the_prompt_only_where_a_split_is_possible() -> None:
    planner = Planner(measured())
    busy = EngineLoad(HOME, in_flight=3)
    assert planner.needs_prompt(busy, EngineLoad(HELPER), TurnFacts())
    assert not planner.needs_prompt(busy, EngineLoad(HELPER, healthy=False), TurnFacts())
    assert not planner.needs_prompt(busy, None, TurnFacts())
    # A helper as busy as the home would stall as many requests computing more of the prompt
    # (it holds no copy): the turn is whole, and no /tokenize round trip is spent on it.
    assert not planner.needs_prompt(busy, EngineLoad(HELPER, in_flight=3), TurnFacts())
    assert planner.needs_prompt(busy, EngineLoad(HELPER, in_flight=2), TurnFacts())
    # A session that split lately may push back: its history must be known, on a busy home.
    assert planner.needs_prompt(EngineLoad(HOME, in_flight=1), EngineLoad(HELPER, in_flight=1),
                                TurnFacts(turns_since_split=0))


def test_idle_home_serves_a_splitting_session_whole_unread() -> None:
    # Nothing ahead on the home and no one to stall there: no placement comes sooner than
    # whole, so no /tokenize round trip is spent, even on a session that split lately. A turn
    # not read keeps no copy on the other engine (the router tells it no push back can
    # follow): the copy stays as it was, and the next turn read counts what it lacks.
    planner = Planner(measured())
    home, helper = EngineLoad(HOME), EngineLoad(HELPER, room_tokens=10_000)
    facts = TurnFacts(turns_since_split=0, history_tokens=3_000, expected_output=40)
    assert not planner.needs_prompt(home, helper, facts)
    decision = planner.decide(home, helper, facts)
    assert (decision.where, decision.home, decision.prefill) == ("whole", HOME, HOME)
    assert not decision.push_back and "nothing in flight" in decision.why


def test_short_delta_on_a_busy_home_stays_whole() -> None:
    # The helper lacks the history: a split would compute all of it there.
    decision = Planner(measured()).decide(EngineLoad(HOME, in_flight=3), EngineLoad(HELPER),
                                          history_turn(delta=20, helper_holds=0))
    assert decision.where == "whole" and decision.home == HOME
    assert "whole ~" in decision.why and "split ~" in decision.why


def test_long_delta_on_a_busy_home_splits_to_an_idle_helper() -> None:
    decision = Planner(measured()).decide(EngineLoad(HOME, in_flight=3), EngineLoad(HELPER),
                                          history_turn(delta=2000, can_push_back=True))
    assert (decision.where, decision.home, decision.prefill) == ("split", HOME, HELPER)
    # A session that splits keeps a copy on the helper, so its next split computes only its
    # delta there.
    assert decision.push_back
    assert decision.estimates["stall_ms"] == 0.0


def test_split_pays_only_where_the_helper_holds_the_history_or_is_idle() -> None:
    planner = Planner(measured())
    # The helper is as busy as the home, and lacks the history: it would compute all of it
    # beside its own requests.
    decision = planner.decide(EngineLoad(HOME, in_flight=3), EngineLoad(HELPER, in_flight=3),
                              history_turn(delta=500, helper_holds=0))
    assert decision.where == "whole"


def test_a_split_recomputing_the_homes_history_must_save_a_fifth() -> None:
    """A helper holding nothing of the history (no copy, no shared tier) recomputes it: that
    cost is sure, the waiting it spares the home's other requests estimated, so, as a move, it
    must cost a fifth less than whole. A helper holding a copy computes the delta alone."""
    planner = Planner(measured())
    helper, busy = EngineLoad(HELPER), EngineLoad(HOME, in_flight=4)
    facts = history_turn(prompt=4096, delta=1000, helper_holds=0)
    options = planner._options(busy, helper, facts)
    assert options["split"].cost_ms < options["whole"].cost_ms < options["split"].cost_ms * 1.25
    near = planner.decide(busy, helper, facts)
    assert near.where == "whole" and "saves too little" in near.why
    assert planner.decide(EngineLoad(HOME, in_flight=6), helper, facts).where == "split"
    assert planner.decide(busy, helper, history_turn(prompt=4096, delta=1000)).where == "split"


def test_itl_target_refuses_a_whole_turn_that_stalls_the_home_over_it() -> None:
    costs = measured(home_ms=0.05, helper_ms=0.05)
    facts = history_turn(delta=400, helper_holds=0)
    home, helper = EngineLoad(HOME, in_flight=1), EngineLoad(HELPER)
    # Cheapest overall: whole (the helper would recompute the history).
    assert Planner(costs).decide(home, helper, facts).where == "whole"
    # But it stalls the home's other request ~20 ms: over a 10 ms target.
    decision = Planner(costs, itl_target_ms=10.0).decide(home, helper, facts)
    assert decision.where == "split" and "ITL target 10 ms" in decision.why


def test_itl_target_without_a_placement_within_it_takes_the_least_stall() -> None:
    costs = measured()
    decision = Planner(costs, itl_target_ms=1.0).decide(
        EngineLoad(HOME, in_flight=2), EngineLoad(HELPER, in_flight=4),
        history_turn(delta=2000, helper_holds=0))
    assert "every placement stalls over" in decision.why
    assert decision.estimates["stall_ms"] <= 2000 * 1.0


def test_a_home_that_is_down_moves_the_session_and_recomputes() -> None:
    decision = Planner(measured()).decide(EngineLoad(HOME, healthy=False), EngineLoad(HELPER),
                                          history_turn())
    assert (decision.where, decision.home, decision.pull) == ("move", HELPER, False)
    assert "is down" in decision.why


def test_an_overloaded_home_moves_the_session_and_pulls_its_history() -> None:
    decision = Planner(measured()).decide(EngineLoad(HOME, in_flight=64, overloaded=True),
                                          EngineLoad(HELPER), history_turn(delta=20,
                                                                           helper_holds=0))
    assert (decision.where, decision.home, decision.prefill) == ("move", HELPER, HOME)
    assert decision.pull and not decision.push_back


def test_a_session_moves_to_its_copy_without_pulling() -> None:
    """The other engine holds a copy of the history (an earlier push back): a move there
    is a whole turn of the other engine's, computing what its copy lacks; nothing crosses
    the link, and the old home, which keeps the history, may get this turn's pushed back."""
    busy, idle = EngineLoad(HOME, in_flight=64, overloaded=True), EngineLoad(HELPER)
    decision = Planner(measured()).decide(busy, idle, history_turn(delta=20,
                                                                   can_push_back=True))
    assert (decision.where, decision.home, decision.prefill) == ("move", HELPER, HELPER)
    assert not decision.pull and decision.push_back
    # By the costs: a home with others in flight, the copy's engine idle and able to serve
    # the turn whole; here the home keeps the session, the copy's engine computing its delta
    # (a split), the cheaper of the two.
    decision = Planner(measured()).decide(EngineLoad(HOME, in_flight=3), idle,
                                          history_turn(delta=400))
    assert "move-copy ~" in decision.why and "move ~" in decision.why
    assert (decision.where, decision.prefill, decision.pull) == ("split", HELPER, False)


def test_of_two_moves_the_planner_takes_the_copy_where_it_costs_less() -> None:
    """Both moves are weighed: pulling writes the whole history over the link after the old
    home computed the delta; the copy's engine computes the delta alone."""
    busy, idle = EngineLoad(HOME, in_flight=64, overloaded=True), EngineLoad(HELPER)
    decision = Planner(measured()).decide(busy, idle, history_turn(delta=20))
    assert (decision.where, decision.pull) == ("move", False)
    # A copy far behind the history (a tenth of it): pulling computes less.
    decision = Planner(measured()).decide(busy, idle, history_turn(delta=20,
                                                                   helper_holds=400))
    assert (decision.where, decision.pull) == ("move", True)


def test_a_home_far_slower_at_decoding_moves_the_session() -> None:
    costs = decoding(home_batch=16, home_ms=990.0, helper_batch=1, helper_ms=99.0)
    facts = long_answer_turn()
    decision = Planner(costs).decide(EngineLoad(HOME, in_flight=15), EngineLoad(HELPER),
                                     facts)
    assert (decision.where, decision.home, decision.pull) == ("move", HELPER, True)


def test_a_session_never_moves_to_a_busier_engine() -> None:
    """A decode step measured at a small batch includes the steps prefills held, so an
    engine measured only while it started its first prompts reads slower per step than a
    busy one: by the costs alone, sessions would move to the crowded engine and drain the
    other, which then never measures again. A move goes only to a less busy engine."""
    costs = decoding(home_batch=1, home_ms=13_000.0, helper_batch=16, helper_ms=3_500.0)
    facts = long_answer_turn()
    assert Planner(costs).decide(EngineLoad(HOME, in_flight=1), EngineLoad(HELPER, in_flight=16),
                                 facts).where != "move"
    assert Planner(costs).decide(EngineLoad(HOME, in_flight=1), EngineLoad(HELPER),
                                 facts).where == "move"


def test_a_session_never_moves_to_an_engine_home_to_as_many_sessions() -> None:
    """A move by the costs (the home slower at decoding, and busier now) goes only where it
    leaves the pair no further apart in sessions: requests in flight are a moment's load,
    and a session moved from an evenly homed pair makes one engine home to two more than the
    other for the rest of their turns."""
    costs = decoding(home_batch=16, home_ms=990.0, helper_batch=1, helper_ms=99.0)
    facts = long_answer_turn()
    planner = Planner(costs)
    even = planner.decide(EngineLoad(HOME, in_flight=15, homed=2),
                          EngineLoad(HELPER, homed=2), facts)
    assert even.where != "move"
    assert planner.decide(EngineLoad(HOME, in_flight=15, homed=3),
                          EngineLoad(HELPER, homed=1), facts).where == "move"


def test_a_home_computing_a_prompt_is_busier_than_one_decoding() -> None:
    """Both engines have one request in flight: the home's is a prompt it is computing, the
    helper's is decoding. The planner reads the prompt there (where counting requests alone
    it would not), so that the costs can weigh a split or a move to a copy. (The queue is not
    itself a cost: waiting out one prompt never justified recomputing a held history on the
    other engine.)"""
    planner = Planner(measured())
    home = EngineLoad(HOME, in_flight=1, prefilling=1)
    helper = EngineLoad(HELPER, in_flight=1)
    assert helper.less_busy_than(home) and not home.less_busy_than(helper)
    assert planner.needs_prompt(home, helper, TurnFacts())
    assert not planner.needs_prompt(EngineLoad(HOME, in_flight=1), helper, TurnFacts())
    decision = planner.decide(home, helper, history_turn(delta=300, helper_holds=0))
    assert decision.where == "whole", decision.why


def test_of_two_engines_computing_a_prompt_the_one_done_sooner_is_less_busy() -> None:
    """Both engines compute a prompt: the home's is long (4 s of it ahead, as estimated),
    the other's nearly done. Counted as prompts they are as busy, and the turn would wait out
    the home's unread; by their prompts ahead the other engine is the less busy, so the
    prompt is read and the turn moves over the shared tier to the engine done sooner. Within
    a factor of two the estimates do not decide (they err by tens of percent): the counts do."""
    planner = Planner(measured(home_ms=3.0, helper_ms=3.0))
    home = EngineLoad(HOME, in_flight=1, prefilling=1, prefill_wait_ms=4000.0)
    other = EngineLoad(HELPER, in_flight=1, prefilling=1, prefill_wait_ms=300.0)
    assert other.less_busy_than(home) and not home.less_busy_than(other)
    assert planner.needs_prompt(home, other, TurnFacts())
    decision = planner.decide(home, other, shared_turn())
    assert (decision.where, decision.home, decision.prefill) == ("move", HELPER, HELPER)
    assert decision.estimates["ttft_ms"] < 4000.0
    near = dataclasses.replace(other, prefill_wait_ms=2500.0)
    assert not near.less_busy_than(home) and not home.less_busy_than(near)
    assert not planner.needs_prompt(home, near, TurnFacts())
    assert planner.decide(home, near, shared_turn()).where != "move"
    # The estimates decide over the counts: two short prompts are done before a long one.
    crowded = EngineLoad(HELPER, in_flight=2, prefilling=2, prefill_wait_ms=300.0)
    assert crowded.less_busy_than(home)


def test_without_another_engine_the_turn_stays_whole() -> None:
    planner = Planner(measured())
    facts = history_turn()
    assert planner.decide(EngineLoad(HOME, in_flight=5), None, facts).where == "whole"
    decision = planner.decide(EngineLoad(HOME, in_flight=5),
                              EngineLoad(HELPER, healthy=False), facts)
    assert decision.where == "whole" and "no other engine" in decision.why


@pytest.mark.parametrize("pin", ["whole", "split", "move", "move-copy"])
def test_a_pinned_placement_is_followed_and_said(pin: str) -> None:
    planner = Planner(measured())
    home, helper = EngineLoad(HOME), EngineLoad(HELPER)
    assert planner.needs_prompt(home, helper, TurnFacts(), pin=pin)  # type: ignore[arg-type]
    decision = planner.decide(home, helper, history_turn(), pin=pin)  # type: ignore[arg-type]
    assert decision.where == pin.split("-")[0] and decision.pinned and "pinned" in decision.why
    assert decision.home == (HELPER if pin.startswith("move") else HOME)
    assert decision.pull == (pin == "move")
    assert decision.prefill == (HOME if pin == "whole" else HELPER) or pin == "move"


def test_a_move_pinned_to_a_copy_there_is_not_pulls() -> None:
    decision = Planner(measured()).decide(EngineLoad(HOME), EngineLoad(HELPER),
                                          history_turn(helper_holds=0), pin="move-copy")
    assert (decision.where, decision.home, decision.prefill, decision.pull) == (
        "move", HELPER, HOME, True)


def test_push_back_wherever_the_helper_has_room_and_never_under_pressure() -> None:
    """A copy on the other engine lets a later turn run on whichever engine waits less
    (split computing only the delta, or a move to the copy), so the planner keeps one
    wherever it fits, except under memory pressure, where it would cost another session
    its history."""
    planner = Planner(measured())
    busy, idle = EngineLoad(HOME, in_flight=3), EngineLoad(HELPER)
    long = dict(delta=2000, can_push_back=True)
    assert planner.decide(busy, idle, history_turn(**long)).push_back  # type: ignore[arg-type]
    # Under pressure on either engine: no copy.
    assert not planner.decide(busy, EngineLoad(HELPER, pressure=True),
                              history_turn(**long)).push_back  # type: ignore[arg-type]
    assert not planner.decide(EngineLoad(HOME, in_flight=3, pressure=True), idle,
                              history_turn(**long)).push_back  # type: ignore[arg-type]
    # A whole turn keeps the copy up to date, whether or not the session split lately.
    for since in (1, SPLIT_MEMORY_TURNS, None):
        facts = history_turn(delta=20, helper_holds=0, can_push_back=True,
                             turns_since_split=since)
        decision = planner.decide(EngineLoad(HOME, in_flight=1), EngineLoad(HELPER, in_flight=1),
                                  facts)
        assert decision.where == "whole" and decision.push_back
    # Nothing to push back with (the last turn, or no token IDs).
    assert not planner.decide(busy, idle, history_turn(delta=2000)).push_back


def test_cold_start_priors_still_split_a_long_delta_beside_busy_decodes() -> None:
    """No measurement at all: the priors rank the placements by tokens and stalls."""
    planner = Planner(CostModel())
    decision = planner.decide(EngineLoad(HOME, in_flight=4), EngineLoad(HELPER),
                              history_turn(delta=3000))
    assert decision.where == "split"
    decision = planner.decide(EngineLoad(HOME, in_flight=4), EngineLoad(HELPER),
                              history_turn(delta=10, helper_holds=0))
    assert decision.where == "whole"


# -- room: a placement that would end other sessions' leases -------------------------------

def test_a_split_the_helper_has_no_room_for_stays_whole() -> None:
    """Under memory pressure a split would make the helper end other sessions' leases to
    hold the prompt (their histories recomputed later): the turn stays whole on its home."""
    planner = Planner(measured())
    busy = EngineLoad(HOME, in_flight=3)
    facts = history_turn(delta=3000, helper_holds=0)
    assert planner.decide(busy, EngineLoad(HELPER, room_tokens=8192), facts).where == "split"
    crowded = planner.decide(busy, EngineLoad(HELPER, room_tokens=1000), facts)
    assert crowded.where == "whole"
    assert "split: would end leases" in crowded.why
    # A helper that holds a copy needs room for the delta only.
    copy = history_turn(delta=3000)
    assert planner.decide(busy, EngineLoad(HELPER, room_tokens=3100), copy).where == "split"


def test_a_move_needs_room_for_the_whole_history() -> None:
    costs = measured()
    for _ in range(5):
        costs.observe_decode(HOME, 1, 10.0, 10.0 + 100 * 50.0, 101)
        costs.observe_decode(HELPER, 1, 10.0, 10.0 + 100 * 1.0, 101)
    planner = Planner(costs)
    home = EngineLoad(HOME, in_flight=1)
    facts = TurnFacts(prompt_tokens=4096, home_holds=4000, block_size=16,
                      expected_output=200)
    assert planner.decide(home, EngineLoad(HELPER, room_tokens=10_000), facts).where == "move"
    assert planner.decide(home, EngineLoad(HELPER, room_tokens=2000), facts).where != "move"
    # An overloaded home does not move a session to an engine without room for it either.
    overloaded = EngineLoad(HOME, in_flight=64, overloaded=True)
    untokenized = planner.decide(overloaded, EngineLoad(HELPER, room_tokens=2000),
                                 TurnFacts(history_tokens=4000))
    assert untokenized.where == "whole"


def test_no_push_back_to_a_helper_without_room_for_the_copy() -> None:
    planner = Planner(measured())
    busy = EngineLoad(HOME, in_flight=3)
    facts = history_turn(delta=3000, helper_holds=0, can_push_back=True)
    assert planner.decide(busy, EngineLoad(HELPER, room_tokens=100_000), facts).push_back
    # Room for the prompt it computes, not for the copy that would outlive the turn.
    tight = planner.decide(busy, EngineLoad(HELPER, room_tokens=4150), facts)
    assert tight.where == "split" and not tight.push_back


# -- a tier both engines read (`--shared-tier`) ----------------------------------------------

def test_no_move_to_a_copy_or_over_the_tier_to_an_engine_home_to_more_sessions() -> None:
    """A move to the copy or over the shared tier is cheap to undo, so it may leave the
    other engine home to two more sessions than the home (from an even pair), but not go to
    an engine already home to more: one such move after another gathered every session of a
    pair on one engine, where their turns queued behind each other's prompts. For room (the
    home cannot hold the turn beside its turns in flight, the other can) it still may."""
    planner = Planner(measured(home_ms=3.0, helper_ms=3.0))
    busy = EngineLoad(HOME, in_flight=2, prefilling=1, capacity_tokens=3200,
                      prefill_wait_ms=5000.0)
    idle = EngineLoad(HELPER, capacity_tokens=3200)
    copies = dataclasses.replace(shared_turn(), shared_tier=False, tier_holds=0,
                                 helper_holds=2700)
    for facts, option in ((shared_turn(), "move-tier"), (copies, "move-copy")):
        even = planner.decide(dataclasses.replace(busy, homed=2),
                              dataclasses.replace(idle, homed=2), facts)
        # Served from the copy or the tier, not pulled over the link.
        assert (even.where, even.home, even.pull) == ("move", HELPER, False), even.why
        assert f"{option} ~" in even.why
        crowded = planner.decide(dataclasses.replace(busy, homed=1),
                                 dataclasses.replace(idle, homed=3), facts)
        assert crowded.where != "move", crowded.why
        assert "not to an engine home to more" in crowded.why, crowded.why
    # For room: the home's cache cannot hold the turn beside its turns in flight.
    full = dataclasses.replace(busy, homed=1, kv_in_flight=2800)
    decision = planner.decide(full, dataclasses.replace(idle, homed=3), shared_turn())
    assert (decision.where, decision.home) == ("move", HELPER), decision.why


def shared_turn(prompt: int = 3000, delta: int = 300, **more: object) -> TurnFacts:
    """A turn adding `delta` tokens to a history its home holds and the shared tier too; the
    other engine holds no copy (with a shared tier nothing is pushed back)."""
    held = prompt - delta
    return TurnFacts(prompt_tokens=prompt, home_holds=held, helper_holds=0, block_size=128,
                     expected_output=30, shared_tier=True, tier_holds=held,
                     **more)  # type: ignore[arg-type]


def test_a_busy_home_moves_the_turn_to_the_idle_engine_over_the_shared_tier() -> None:
    """The pressure case: the home runs another session's turn, the other engine is idle and
    its cache is full of other sessions' leases. Without a shared tier the turn stays whole
    (the other engine would compute the whole history, or end leases); with one the other
    engine reads the history and computes only the delta."""
    planner = Planner(measured(home_ms=3.0, helper_ms=3.0))
    busy = EngineLoad(HOME, in_flight=1, prefilling=1, room_tokens=0, capacity_tokens=3200,
                      kv_in_flight=2800)
    idle = EngineLoad(HELPER, room_tokens=0, capacity_tokens=3200)
    decision = planner.decide(busy, idle, shared_turn())
    assert (decision.where, decision.home, decision.prefill, decision.pull) == (
        "move", HELPER, HELPER, False)
    assert "move-tier ~" in decision.why
    private = dataclasses.replace(shared_turn(), shared_tier=False, tier_holds=0)
    assert planner.decide(busy, idle, private).where == "whole"


def test_a_move_over_the_shared_tier_costs_its_read_and_needs_room_in_the_cache() -> None:
    planner = Planner(measured(home_ms=3.0, helper_ms=3.0))
    busy = EngineLoad(HOME, in_flight=1, prefilling=1, capacity_tokens=3200, kv_in_flight=2800)
    # Not to an engine whose cache cannot hold the prompt at all.
    small = EngineLoad(HELPER, capacity_tokens=2000)
    assert planner.decide(busy, small, shared_turn()).where == "whole"
    # Nor to one as busy as the home.
    as_busy = EngineLoad(HELPER, in_flight=1, prefilling=1, capacity_tokens=3200,
                         kv_in_flight=2800)
    assert planner.decide(busy, as_busy, shared_turn()).where == "whole"
    # A read far slower than the delta's compute does not pay.
    slow = Planner(measured(home_ms=3.0, helper_ms=3.0))
    slow.costs.priors = Priors(tier_read_tokens_per_ms=0.5)
    idle = EngineLoad(HELPER, capacity_tokens=3200)
    assert slow.decide(busy, idle, shared_turn()).where == "whole"
    assert planner.decide(busy, idle, shared_turn()).where == "move"


def test_with_a_shared_tier_nothing_is_pushed_back() -> None:
    """The other engine reads the history from the shared tier when a turn needs it there:
    a copy would only take its cache meanwhile."""
    planner = Planner(measured())
    busy, idle = EngineLoad(HOME, in_flight=3), EngineLoad(HELPER)
    assert planner.decide(busy, idle, history_turn(delta=2000, can_push_back=True)).push_back
    facts = shared_turn(prompt=4096, delta=2000, can_push_back=True)
    assert not planner.decide(busy, idle, facts).push_back


def test_a_split_reads_from_the_shared_tier_what_the_helper_lacks() -> None:
    """A long delta beside busy decodes still splits; the helper reads the history rather
    than compute it, so the split pays where, without the tier, it would not."""
    planner = Planner(measured())
    busy, helper = EngineLoad(HOME, in_flight=4), EngineLoad(HELPER, in_flight=1)
    facts = shared_turn(prompt=8000, delta=3000)
    private = dataclasses.replace(facts, shared_tier=False, tier_holds=0)
    assert planner.decide(busy, helper, private).where == "whole"
    assert planner.decide(busy, helper, facts).where == "split"


def test_move_tier_can_be_pinned() -> None:
    decision = Planner(measured()).decide(EngineLoad(HOME), EngineLoad(HELPER), shared_turn(),
                                          pin="move-tier")
    assert (decision.where, decision.home, decision.prefill, decision.pull,
            decision.pinned) == ("move", HELPER, HELPER, False, True)


def test_a_turn_the_home_has_no_room_for_beside_its_turns_waits_for_one() -> None:
    """The estimate of a whole turn on a home whose turns in flight leave no room for it
    includes waiting about a turn's decode; with room, none."""
    planner = Planner(decoding(1, 100 * 40.0, 1, 100 * 40.0))
    facts = shared_turn()
    roomy = EngineLoad(HOME, in_flight=1, capacity_tokens=8000, kv_in_flight=2800)
    full = dataclasses.replace(roomy, capacity_tokens=3200)
    alone = EngineLoad(HELPER, in_flight=1, capacity_tokens=8000, kv_in_flight=2800)
    with_room = planner.decide(roomy, alone, facts).estimates["ttft_ms"]
    # (The other engine as full: where it had room, the turn would move there.)
    decision = planner.decide(full, dataclasses.replace(alone, capacity_tokens=3200), facts)
    assert decision.where == "whole", decision.why
    assert decision.estimates["ttft_ms"] == pytest.approx(with_room + 30 * 40.0, rel=0.01)


def test_a_turn_its_home_has_no_room_for_moves_to_an_as_busy_engine_with_room() -> None:
    """Both engines decode one turn and compute nothing: neither is the less busy, so by
    their loads the session stays. But the home's cache cannot hold the turn beside its turn
    in flight and the other's can: the turn would wait out a decode at home for room (a
    count of KV, not an estimate), and the other engine, reading the history from the shared
    tier, starts it at once. Where the other has no room either, it stays; the reason says
    what the cheaper placements lacked."""
    planner = Planner(decoding(1, 100 * 40.0, 1, 100 * 40.0))
    facts = shared_turn()
    full = EngineLoad(HOME, in_flight=1, capacity_tokens=3200, kv_in_flight=2800)
    roomy = EngineLoad(HELPER, in_flight=1, capacity_tokens=8000, kv_in_flight=2800)
    assert not roomy.less_busy_than(full) and not full.less_busy_than(roomy)
    decision = planner.decide(full, roomy, facts)
    assert (decision.where, decision.home, decision.prefill, decision.pull) == (
        "move", HELPER, HELPER, False), decision.why
    both_full = dataclasses.replace(roomy, capacity_tokens=3200)
    stays = planner.decide(full, both_full, facts)
    assert stays.where == "whole"
    assert ("; split: no room beside the turns in flight; move: no room beside the turns in "
            "flight, not to a busier engine)") in stays.why, stays.why


def test_a_prompt_held_for_a_turn_landing_on_its_engine_counts_the_hold() -> None:
    """A turn that moves KV lands on the home 1 s from now, as planned. A whole turn there,
    whose prompt computes for 1.5 s, would be held until it lands (`router.landings`): its
    estimate counts the second, and the split, a hair dearer than whole without it, goes
    instead. A turn landing after the prompt's compute would be done holds nothing."""
    planner = Planner(measured(home_ms=3.0, helper_ms=3.0))
    facts = history_turn(delta=500)
    home, helper = EngineLoad(HOME, in_flight=1), EngineLoad(HELPER, in_flight=1)
    free = planner.decide(home, helper, facts)
    assert free.where == "whole" and free.estimates["compute_ms"] == pytest.approx(1536.0)
    landing = planner.decide(dataclasses.replace(home, landing_ms=(1000.0,)), helper, facts)
    assert landing.where == "split", landing.why
    assert "whole ~7072 ms" in landing.why  # 6,072 ms, and the second
    late = planner.decide(dataclasses.replace(home, landing_ms=(5000.0,)), helper, facts)
    assert late.where == "whole" and late.estimates == free.estimates
    # Pinned whole, its estimates and reason say it.
    held = planner.decide(dataclasses.replace(home, landing_ms=(1000.0, 200.0)), helper, facts,
                          pin="whole")
    assert held.estimates["ttft_ms"] == pytest.approx(free.estimates["ttft_ms"] + 1000.0)
    assert held.estimates["prefill_done_ms"] == pytest.approx(2536.0)
    assert "~1000 ms held for a landing" in held.why
    # The hold and the prompts ahead overlap: a turn waits out the longer, not both.
    queued = dataclasses.replace(home, landing_ms=(1000.0,), prefill_wait_ms=1200.0)
    behind = planner.decide(queued, helper, facts, pin="whole")
    assert behind.estimates["ttft_ms"] == pytest.approx(free.estimates["ttft_ms"] + 1200.0)
    assert "held for a landing" not in behind.why


def test_turns_in_flight_count_each_turns_kv_until_it_ends_or_its_engine_idles() -> None:
    kv = TurnsInFlight(max_turns=3)
    kv.begin("a", HOME, 1000)
    kv.begin("b", HOME, 500)
    kv.begin("c", HELPER, 200)
    assert (kv.kv_tokens(HOME), kv.kv_tokens(HELPER)) == (1500, 200)
    kv.begin("a", HELPER, 100)  # replanned: counted once, where it went last
    assert (kv.kv_tokens(HOME), kv.kv_tokens(HELPER)) == (500, 300)
    kv.end("b")
    kv.end("b")
    assert kv.kv_tokens(HOME) == 0
    kv.begin("d", HOME, 50)  # bounded: the oldest turn goes
    kv.begin("e", HOME, 50)
    assert kv.kv_tokens(HELPER) == 100
    kv.idle(HOME)
    assert kv.kv_tokens(HOME) == 0 and kv.kv_tokens(HELPER) == 100


def test_turns_in_flight_count_the_prompts_ahead_where_they_are_computed() -> None:
    turns = TurnsInFlight()
    # a splits: decoded on the home, its prompt computed on the helper; b is the helper's own.
    turns.begin("a", HOME, 1000, HELPER, prefill_ms=4000.0, at_s=10.0)
    turns.begin("b", HELPER, 500, HELPER, prefill_ms=1000.0, at_s=11.0)
    # Both pending at 12 s: 5 s of estimates, of which the 2 s since a was placed are done.
    assert turns.prefill_wait_ms(HELPER, pending=2, now_s=12.0) == pytest.approx(3000)
    # a's answer began (first come, first served): b alone is ahead, placed 0.5 s ago.
    assert turns.prefill_wait_ms(HELPER, pending=1, now_s=11.5) == pytest.approx(500)
    assert turns.prefill_wait_ms(HELPER, pending=0, now_s=12.0) == 0
    assert turns.prefill_wait_ms(HOME, pending=1, now_s=12.0) == 0  # a's KV only, no compute
    assert turns.kv_tokens(HOME) == 1000
    turns.end("b")
    assert turns.prefill_wait_ms(HELPER, pending=1, now_s=12.0) == pytest.approx(2000)
    assert turns.prefill_wait_ms(HELPER, pending=1, now_s=20.0) == 0


def test_a_prompt_queued_behind_another_waits_in_full_until_the_engine_answers_that_one() -> None:
    turns = TurnsInFlight()
    turns.begin("a", HOME, 1000, HOME, prefill_ms=4000.0, at_s=10.0)
    turns.begin("b", HOME, 500, HOME, prefill_ms=1000.0, at_s=11.0)
    # At 16 s a took longer than its estimate and is not answered: b has not begun.
    assert turns.prefill_wait_ms(HOME, pending=2, now_s=16.0) == pytest.approx(1000)
    # a's answer began at 15 s: b is computed since then, not since it was placed at 11 s.
    assert turns.prefill_wait_ms(HOME, pending=1, now_s=15.5,
                                 answered_ago_s=0.5) == pytest.approx(500)
    # An answer that began before b was placed: b is computed since it was placed.
    assert turns.prefill_wait_ms(HOME, pending=1, now_s=11.5,
                                 answered_ago_s=5.0) == pytest.approx(500)


def test_a_prompt_held_back_counts_in_full_until_it_is_sent() -> None:
    turns = TurnsInFlight()
    turns.begin("a", HOME, 1000, HOME, prefill_ms=4000.0, at_s=10.0)
    turns.begin("b", HELPER, 500, HOME, prefill_ms=3000.0, held=True)
    # Held (not among the engine's requests): in full, beside a's rest of the one pending.
    assert turns.prefill_wait_ms(HOME, pending=1, now_s=12.0) == pytest.approx(5000)
    assert turns.prefill_wait_ms(HOME, pending=0, now_s=12.0) == pytest.approx(3000)
    turns.idle(HOME)  # nothing in flight there: a goes, b is still to be sent
    assert turns.prefill_wait_ms(HOME, pending=0, now_s=12.0) == pytest.approx(3000)
    assert turns.kv_tokens(HELPER) == 500 and turns.kv_tokens(HOME) == 0
    turns.sent("b", at_s=13.0, shared=True)
    assert turns.prefill_wait_ms(HOME, pending=0, now_s=13.5) == 0
    assert turns.prefill_wait_ms(HOME, pending=1, now_s=13.5) == pytest.approx(2500)
    assert turns.end("b") is True  # sent while another prompt was unanswered
    turns.sent("b", at_s=14.0, shared=False)  # ended: nothing to send
    assert turns.prefill_wait_ms(HOME, pending=1, now_s=14.0) == 0


def test_a_split_to_a_helper_with_a_long_prompt_ahead_stays_whole() -> None:
    """The helper computes a long prompt of another session's (its estimate, counted by
    `TurnsInFlight`): a split there would wait for it, so the busy home computes the delta."""
    planner = Planner(measured())
    facts = history_turn(delta=2000)
    home = EngineLoad(HOME, in_flight=3)
    free = planner.decide(home, EngineLoad(HELPER, in_flight=1), facts)
    assert free.where == "split"
    queued = planner.decide(home, EngineLoad(HELPER, in_flight=1, prefilling=1,
                                             prefill_wait_ms=10_000.0), facts)
    assert queued.where == "whole"
    # The wait counts where the home has prompts ahead too: whole's time to the first token.
    behind = planner.decide(dataclasses.replace(home, prefill_wait_ms=600.0),
                            EngineLoad(HELPER, in_flight=1, prefill_wait_ms=10_000.0), facts)
    assert behind.estimates["ttft_ms"] == pytest.approx(
        queued.estimates["ttft_ms"] + 600.0)
    assert behind.estimates["compute_ms"] == pytest.approx(2000, rel=0.05)
    assert "~600 ms of prompts ahead" in behind.why


def test_a_prompt_not_read_is_counted_at_what_the_engines_prompts_measured() -> None:
    costs = CostModel()
    assert costs.prompt_ms(HOME) == 0.0
    costs.observe_prefill(HOME, 1000, computed=3, engine_ms=30.0)  # teaches no cost per token
    costs.observe_prefill(HOME, 1000, computed=None, engine_ms=80.0)
    assert costs.prompt_ms(HOME) == pytest.approx(30.0 + 0.2 * 50.0)
    assert not costs.measured(HOME) and costs.prompt_ms(HELPER) == 0.0
    # An idle home's turn, its prompt not read, is counted at that measure.
    unread = Planner(costs).decide(EngineLoad(HOME), EngineLoad(HELPER), TurnFacts())
    assert unread.where == "whole" and unread.estimates["compute_ms"] == costs.prompt_ms(HOME)


def test_no_split_or_pull_where_either_engine_lacks_room_beside_its_turns() -> None:
    """A split holds the prompt's KV on both engines at once: where the home cannot hold it
    beside its turns in flight, the write would wait there holding the helper's blocks. The
    turn goes whole (or over the shared tier to an engine with room) instead."""
    planner = Planner(measured())
    facts = shared_turn(prompt=8000, delta=3000)
    busy = EngineLoad(HOME, in_flight=4, capacity_tokens=20_000, kv_in_flight=5000)
    helper = EngineLoad(HELPER, in_flight=1, capacity_tokens=20_000, kv_in_flight=2000)
    assert planner.decide(busy, helper, facts).where == "split"
    full_home = dataclasses.replace(busy, kv_in_flight=15_000)
    assert planner.decide(full_home, helper, facts).where != "split"
    full_helper = dataclasses.replace(helper, kv_in_flight=15_000)
    assert planner.decide(busy, full_helper, facts).where != "split"


def test_a_split_waits_for_the_prompts_its_home_has_ahead() -> None:
    """The home computes another session's long prompt: the split's first token is a step of
    the home's, after that prompt, so a split does not get past it (its estimate says so).
    The idle engine reading the history from the shared tier does."""
    planner = Planner(measured())
    facts = shared_turn(prompt=3500, delta=300)
    helper = EngineLoad(HELPER, in_flight=1)
    home = EngineLoad(HOME, in_flight=3, prefilling=1, prefill_wait_ms=1000.0)
    # A helper holding a copy of the history computes the delta alone: ~300 ms.
    copy = dataclasses.replace(facts, shared_tier=False, tier_holds=0, helper_holds=3200)
    split = planner.decide(home, helper, copy, pin="split")
    assert split.estimates["ttft_ms"] >= 1000.0
    assert split.estimates["home_wait_ms"] == 1000.0
    idle_home = dataclasses.replace(home, prefilling=0, prefill_wait_ms=0.0)
    assert planner.decide(idle_home, helper, copy, pin="split").estimates["ttft_ms"] < 400.0
    # Over the shared tier, the turn moves to the engine with nothing ahead.
    decision = planner.decide(home, helper, facts)
    assert decision.where == "move" and decision.prefill == HELPER
    assert decision.estimates["ttft_ms"] < 1000.0


def test_a_prompt_not_read_is_counted_at_its_estimated_delta_where_there_is_one() -> None:
    costs = measured(home_ms=2.0)
    facts = TurnFacts(history_tokens=3000, prompt_estimate=3500)
    decision = Planner(costs).decide(EngineLoad(HOME), EngineLoad(HELPER), facts)
    assert decision.where == "whole"
    assert decision.estimates["compute_ms"] == pytest.approx(500 * 2.0)
    without = Planner(costs).decide(EngineLoad(HOME), EngineLoad(HELPER),
                                    dataclasses.replace(facts, prompt_estimate=None))
    assert without.estimates["compute_ms"] == costs.prompt_ms(HOME)
    # The home down: the other engine recomputes the whole estimated prompt.
    moved = Planner(costs).decide(EngineLoad(HOME, healthy=False), EngineLoad(HELPER), facts)
    assert moved.where == "move" and moved.prefill == HELPER
    assert moved.estimates["compute_ms"] == pytest.approx(3500 * 1.0)


def test_a_busy_homes_turn_is_whole_unread_only_where_a_longer_delta_keeps_it_whole() -> None:
    # Both engines compute at 1 ms a token and read their tier at 1 ms a token: on a home
    # decoding three others, a delta of 1,000 tokens or more on a 3,000-token history splits.
    costs = measured()
    for name in (HOME, HELPER):
        costs.observe_prefill(name, 2000, 1000, 2000.0, restored=1000)
    planner = Planner(costs)
    home, helper = EngineLoad(HOME, in_flight=3), EngineLoad(HELPER)

    def read(prompt: int) -> TurnFacts:
        return TurnFacts(prompt_tokens=prompt, home_holds=3000, block_size=16,
                         expected_output=100, history_tokens=3000, shared_tier=True,
                         tier_holds=3000)

    def unread(estimate: int) -> TurnFacts:
        return dataclasses.replace(read(estimate), prompt_tokens=None,
                                   prompt_estimate=estimate)

    assert planner.decide(home, helper, read(3200)).where == "whole"
    decided = planner.decide_unread(home, helper, unread(3200))
    assert decided is not None and decided.where == "whole" and not decided.push_back
    assert decided.home == decided.prefill == HOME and "not read" in decided.why
    # 600 new tokens read are whole, but taken twice as long they would split: the estimate
    # is not sure enough to spare the read.
    assert planner.decide(home, helper, read(3600)).where == "whole"
    assert planner.decide(home, helper, read(3000 + 1200)).where == "split"
    assert planner.decide_unread(home, helper, unread(3600)) is None
    # Nor where a placement is pinned, the home is at its limit, there is no helper, or a
    # copy could be pushed back after the turn (no shared tier).
    assert planner.decide_unread(home, helper, unread(3200), pin="whole") is None
    full = dataclasses.replace(home, overloaded=True)
    assert planner.decide_unread(full, helper, unread(3200)) is None
    assert planner.decide_unread(home, None, unread(3200)) is None
    private = dataclasses.replace(unread(3200), shared_tier=False, tier_holds=0,
                                  can_push_back=True)
    assert planner.decide(home, helper, dataclasses.replace(read(3200), shared_tier=False,
                                                            tier_holds=0,
                                                            can_push_back=True)).push_back
    assert planner.decide_unread(home, helper, private) is None
