"""The planner's weighing of a turn whose prompt's length it knows (`WeighingPlanner`, the
planner the modes run): each placement's estimated cost from the cost model, the cheapest
under the ITL target, and the decision that names it. A turn whose prompt is not read (an
idle home's, served whole) is decided by `Planner.decide` alone (`router.planner`); a busy
home's is first weighed at its estimated length (`guessed_facts`), and read only where that
could change the decision (`WeighingPlanner.decide_unread`).

A placement's cost is its own time to the first token, plus the time it stalls each other
request decoding on the engine that computes, plus the turn's decode at that engine's batch:
the waiting it adds across all requests. Its time to the first token begins with the prompts
the computing engine has ahead of it (`EngineLoad.prefill_wait_ms`: their estimates, as the
router counts its turns in flight), and a split's or a pull's ends with a step of the engine
that decodes it, after the prompts that engine has ahead. Where an engine's cache cannot hold
the turn beside the turns in flight there (as the router counts their KV), the turn first
waits for them, about a turn's decode each. A split, which holds the prompt's KV on both
engines at once, is taken only where both have that room. The cheapest goes, with the ITL
target as a constraint: a placement that would stall others longer than the target is refused
while one within it is possible. A `move` must beat staying by a margin, so that sessions do
not bounce, and so must a split whose helper recomputes history the home holds.

Memory is a constraint too: a placement that would have an engine take more KV than it has
room for (`EngineLoad.room_tokens`: its cache less what the sessions' leases hold there, as the
router counts them, `Holdings`; or, where the engines share a tier that holds those leases' KV,
its cache less its turns in flight, `TurnsInFlight`) is not taken. A session moves only to an
engine less busy than its home, or to one with room for the turn beside its turns in flight
where the home has none; pulling its history (which needs room on both), only to a less busy
engine home to fewer sessions. A copy of the history is pushed to the other engine after a
turn where it has room and there is no pressure and no shared tier
(`WeighingPlanner._push_back`); a turn not read keeps none. Where a placement estimated cheaper
was not taken, the decision's reason says what it lacked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from turnkv_server.router.decisions import Choice, Decision, SessionPlace, TurnFacts, Where
from turnkv_server.router.engines import Engine
from turnkv_server.router.planner import EngineLoad, Planner, tokens_to_compute
from turnkv_server.router.sessions import Session
from turnkv_server.router.token_history import common_prefix_len


def read_facts(prompt_ids: list[int], session: Session | None, place: SessionPlace | None,
               home: Engine, other: Engine | None, can_push_back: bool,
               shared_tier: bool = False) -> TurnFacts:
    """What each engine holds of a prompt the router read: the history's prefix the prompt
    keeps, on the home where it served the last turn, on the other engine as far as its copy
    goes, and in the tier both read (`shared_tier`), which every engine writes what it
    computes to."""
    prompt = len(prompt_ids)
    shared = 0
    if session is not None and place is not None:
        shared = (common_prefix_len(prompt_ids, session.tokens) if place.tokens_current
                  else min(prompt, place.history_len))
    return _facts(prompt, shared, session, place, home, other, can_push_back, shared_tier)


def guessed_facts(estimate: int, session: Session | None, place: SessionPlace | None,
                  home: Engine, other: Engine | None, can_push_back: bool,
                  shared_tier: bool = False) -> TurnFacts:
    """`read_facts` of a prompt not read, `estimate` tokens long, counted as keeping the
    session's whole history (an edit is seen only by reading the prompt)."""
    shared = min(estimate, place.history_len) if session is not None and place else 0
    return replace(_facts(estimate, shared, session, place, home, other, can_push_back,
                          shared_tier), prompt_tokens=None, prompt_estimate=estimate)


def _facts(prompt: int, shared: int, session: Session | None, place: SessionPlace | None,
           home: Engine, other: Engine | None, can_push_back: bool,
           shared_tier: bool) -> TurnFacts:
    home_holds = shared if session is not None and session.decode == home.name else 0
    copy = place is not None and other is not None and place.copy_on == other.name
    return TurnFacts(
        prompt_tokens=prompt, home_holds=home_holds,
        helper_holds=min(shared, place.copy_tokens) if copy and place else 0,
        block_size=home.block_size,
        expected_output=round(place.expected_output) if place else 0,
        turns_since_split=place.turns_since_split if place else None,
        history_tokens=place.history_len if place else 0, can_push_back=can_push_back,
        shared_tier=shared_tier, tier_holds=shared if shared_tier else 0)


# A turn weighed unread is weighed with its delta this much longer than its estimate: a
# request's size tells its tokens at the session's last tokens per byte, and a tool's output
# holds more of them per byte than the chat before it.
GUESS_MARGIN = 1.0

# A move must cost this fraction less than the best placement on the home: its benefit is
# estimated from one turn, its cost (the history's KV over the link) is sure. So must a split
# whose helper recomputes history the home holds (no copy there, no shared tier).
MOVE_MARGIN = 0.2


@dataclass(frozen=True)
class _Option:
    where: Where
    prefill: EngineLoad
    home: EngineLoad
    ttft_ms: float  # to the first token
    stall_ms: float  # of each other request decoding on `prefill`
    cost_ms: float  # waiting added across all requests
    # What it needs and lacks (see the module's text): none, it fits.
    refused: tuple[str, ...] = ()
    compute_ms: float = 0.0  # of its prompt, on `prefill`: what later prompts there wait for
    # Where the KV is written into the engine that decodes (a split, a pull): the prompts that
    # engine had ahead of the turn, which its first token waits for.
    home_wait_ms: float = 0.0
    held_ms: float = 0.0  # held back, on `prefill`, for the turns landing there
    recomputes: bool = False  # computes more of the prompt than whole on the home would

    @property
    def fits(self) -> bool:
        return not self.refused


def _unmet(needs: dict[str, bool]) -> tuple[str, ...]:
    """Of a placement's needs, by what each says when unmet, those it lacks."""
    return tuple(unmet for unmet, met in needs.items() if not met)


class WeighingPlanner(Planner):
    """The planner, with its weighing of placements by their costs."""

    def decide_unread(self, home: EngineLoad, helper: EngineLoad | None, facts: TurnFacts,
                      pin: Choice | None = None) -> Decision | None:
        """A turn `needs_prompt` would read, decided whole without reading it where reading
        could not change the decision: weighed at its estimated length with its delta taken
        `1 + GUESS_MARGIN` times as long (the request's size tells the length only as the
        session's last tokens per byte do), whole is still the least waiting, and no copy is
        to be pushed back after it. None: read the prompt (`facts`: `guessed_facts`)."""
        guess = facts.prompt_estimate
        if (guess is None or pin is not None or helper is None or not helper.healthy
                or home.overloaded or not home.healthy):
            return None
        delta = max(0, guess - facts.history_tokens)
        longer = replace(facts, prompt_tokens=facts.history_tokens
                         + math.ceil(delta * (1 + GUESS_MARGIN)))
        decision = self._weigh(home, helper, longer, None)
        if decision.where != "whole" or decision.push_back:
            return None
        return replace(decision, why=f"{decision.why} (not read: ~{guess} tokens by its size, "
                                     f"weighed with {longer.prompt_tokens})")

    def _weigh(self, home: EngineLoad, other: EngineLoad, facts: TurnFacts,
               pin: Choice | None) -> Decision:
        options = self._options(home, other, facts)
        if pin is not None:
            # No copy to move to: the move pulls the history instead.
            pinned = options.get(pin) or options["move"]
            return self._decision(pinned, options, home, other, facts, "pinned", pinned=True)
        moves = [o for o in (options["move"], options.get("move-copy"),
                             options.get("move-tier")) if o and o.fits]
        if home.overloaded and not other.overloaded and moves:
            return self._decision(min(moves, key=lambda o: o.cost_ms), options, home, other,
                                  facts, f"{home.name} is overloaded")
        chosen, reason = self._choose(options)
        return self._decision(chosen, options, home, other, facts, reason)

    # -- the options ---------------------------------------------------------------------

    def _options(self, home: EngineLoad, other: EngineLoad, facts: TurnFacts
                 ) -> dict[Choice, _Option]:
        prompt = facts.prompt_tokens or 0
        block, out = facts.block_size, facts.expected_output
        costs = self.costs
        # Room on the other engine: beside its leases, or where the engines share a tier
        # (whose copy of the leases' KV their sessions would read back), beside its requests.
        fits = other.fits_cache if facts.shared_tier else other.fits
        no_room = ("bigger than the other engine's cache" if facts.shared_tier
                   else "would end leases")
        # Whole: the home computes what it lacks, stalling its other requests meanwhile.
        whole_n = tokens_to_compute(prompt, facts.home_holds, block)
        whole_ms = costs.prefill_ms(home.name, prompt, whole_n)
        home_decode = out * costs.decode_step_ms(home.name, home.in_flight + 1)
        # A turn waits for room where a cache cannot hold it beside the turns in flight there.
        # And behind the prompts each engine has ahead of it.
        # And, a long prompt, held back for the turns that land there (`router.landings`).
        home_wait = self._room_wait(home, prompt + out, out) + home.prefill_wait_ms
        other_wait = self._room_wait(other, prompt + out, out) + other.prefill_wait_ms
        whole_held = _held_ms(home, whole_ms)
        whole = _Option("whole", home, home, home_wait + whole_held + whole_ms,
                        _stall(whole_ms, home),
                        home_wait + whole_held + whole_ms * (1 + home.in_flight) + home_decode,
                        compute_ms=whole_ms, held_ms=whole_held)
        # What the other engine lacks: beyond its copy, or what it reads of the shared tier.
        # Split: the helper computes what it lacks and writes what the home lacks.
        split_n, read_n = self._other_lacks(facts)
        split_compute = (costs.prefill_ms(other.name, prompt, split_n)
                         + costs.tier_read_ms(other.name, read_n))
        # The home takes the KV in and gives the first token at a step of its own: only after
        # the prompts it has ahead, which it computes first, a prompt in progress holding its
        # steps (so a split does not get past a home's queue, it only adds no prompt to it).
        split_held = _held_ms(other, split_compute)
        split_ms = (max(other.prefill_wait_ms + split_held + split_compute
                        + costs.transfer_ms(whole_n), home.prefill_wait_ms)
                    + costs.split_overhead_ms(home.name))
        # Both engines hold the prompt's KV at once (the helper as it computes, the home as it
        # receives): under pressure that takes twice the room of any other placement, and a
        # write into a home that has none waits there holding the helper's blocks. Only where
        # both have room beside their turns in flight.
        both_room = not (home.waits_for_room(prompt + out) or other.waits_for_room(prompt))
        # A session moves only to a less busy engine (below), or where its home has no room
        # for the turn beside its turns in flight and the other has: the wait for room is a
        # count of KV, not an estimate, and the other engine starts the turn at once.
        for_room = home.waits_for_room(prompt + out) and not other.waits_for_room(prompt + out)
        idler = other.less_busy_than(home) or for_room
        # Nor, to a copy or over the tier, for a moment's lead, to an engine home to more
        # sessions than the home already: one by one such moves gather every session on one
        # engine, whose turns then queue behind each other's prompts. For room it may.
        not_crowded = for_room or other.homes_fewer_than(home, slack=1)
        crowded = "not to an engine home to more"
        in_flight_room = "no room beside the turns in flight"
        split = _Option("split", other, home, split_ms, _stall(split_compute, other),
                        split_ms + split_compute * other.in_flight + home_decode,
                        refused=_unmet({no_room: fits(split_n + read_n),
                                        in_flight_room: both_room}),
                        compute_ms=split_compute, home_wait_ms=home.prefill_wait_ms,
                        held_ms=split_held, recomputes=split_n > whole_n)
        # Move, pulling: the old home computes the delta and writes the whole prompt's KV to
        # the other engine, which decodes there from now on, at its own batch (and, as a
        # split's home, after the prompts it has ahead).
        move_ms = (max(home.prefill_wait_ms + whole_held + whole_ms + costs.transfer_ms(prompt),
                       other.prefill_wait_ms) + costs.split_overhead_ms(other.name))
        moved_decode = out * costs.decode_step_ms(other.name, other.in_flight + 1)
        options: dict[Choice, _Option] = {"whole": whole, "split": split}
        if facts.helper_holds:
            # Move, to the copy: the other engine holds the history (a push back left it
            # there), so it serves the turn whole, computing what its copy lacks, and
            # nothing crosses the link at the turn. A whole turn of the other engine's.
            copy_n = tokens_to_compute(prompt, facts.helper_holds, block)
            copy_ms = costs.prefill_ms(other.name, prompt, copy_n)
            copy_wait = other_wait + _held_ms(other, copy_ms)
            options["move-copy"] = _Option(
                "move", other, other, copy_wait + copy_ms, _stall(copy_ms, other),
                copy_wait + copy_ms * (1 + other.in_flight) + moved_decode,
                refused=_unmet({no_room: fits(copy_n + out), "not to a busier engine": idler,
                                crowded: not_crowded}),
                compute_ms=copy_ms, held_ms=copy_wait - other_wait)
        # Only to a less busy engine: a decode step measured at a small batch includes the
        # steps that prefills held, so by its costs alone an engine measured while it started
        # its first prompts reads slower than a crowded one, and sessions would drain to it.
        # Nor to one home to as many sessions: requests in flight are a moment's load, the
        # sessions homed the load to come; a move that leaves one engine home to more
        # sessions than the other is paid back on every later turn of theirs.
        options["move"] = _Option(
            "move", home, other, move_ms, _stall(whole_ms, home),
            move_ms + whole_ms * home.in_flight + moved_decode,
            refused=_unmet({no_room: fits(prompt + out), in_flight_room: both_room,
                            "not to a busier engine": other.less_busy_than(home),
                            "not to an engine home to as many": other.homes_fewer_than(home)}),
            compute_ms=whole_ms, home_wait_ms=other.prefill_wait_ms, held_ms=whole_held)
        if facts.tier_holds:
            # Move, over the shared tier: the other engine reads the history from the tier
            # both engines write to (what its own cache lacks of it) and computes the rest, as
            # a whole turn of its own. Only to a less busy engine; held back by the homes'
            # counts less than a pull is: the next turn can go back the same way, for a read.
            tier_ms, tier_wait = split_compute, other_wait + split_held
            options["move-tier"] = _Option(
                "move", other, other, tier_wait + tier_ms, _stall(tier_ms, other),
                tier_wait + tier_ms * (1 + other.in_flight) + moved_decode,
                refused=_unmet({no_room: fits(prompt + out), "not to a busier engine": idler,
                                crowded: not_crowded}),
                compute_ms=tier_ms, held_ms=split_held)
        return options

    def _room_wait(self, engine: EngineLoad, tokens: int, out: int) -> float:
        """How long a turn of `tokens` tokens of KV waits on `engine` for room: where its
        cache cannot hold them beside its turns in flight, which then run about one at a
        time, a turn's decode (as long as this session's own take) for each of them."""
        if not engine.waits_for_room(tokens):
            return 0.0
        step = self.costs.decode_step_ms(engine.name, engine.in_flight)
        return max(1, engine.in_flight) * max(1, out) * step

    @staticmethod
    def _other_lacks(facts: TurnFacts) -> tuple[int, int]:
        """Of the prompt, the tokens the other engine computes (what neither its copy of the
        history nor the shared tier holds) and those it reads from the shared tier."""
        prompt, block = facts.prompt_tokens or 0, facts.block_size
        own = tokens_to_compute(prompt, facts.helper_holds, block)
        if facts.tier_holds <= facts.helper_holds:
            return own, 0
        lacks = tokens_to_compute(prompt, facts.tier_holds, block)
        return lacks, own - lacks

    def _choose(self, options: dict[Choice, _Option]) -> tuple[_Option, str]:
        stay = [o for o in (options["whole"], options["split"]) if o.fits]
        best = min(stay, key=lambda o: o.cost_ms)
        whole, reason = options["whole"], None
        if best.recomputes and whole.fits and best.cost_ms > whole.cost_ms * (1 - MOVE_MARGIN):
            best, reason = whole, "a split recomputing what the home holds saves too little"
        moves = [o for o in (options.get("move-copy"), options["move"],
                             options.get("move-tier")) if o and o.fits]
        move = min(moves, key=lambda o: o.cost_ms) if moves else None
        if move is not None and move.cost_ms < best.cost_ms * (1 - MOVE_MARGIN):
            best, reason = move, None
        target = self.itl_target_ms
        if target is None or best.stall_ms <= target:
            return best, reason or self._least_waiting(options, best)
        within = [o for o in (*stay, *moves) if o.stall_ms <= target]
        if within:
            pick = min(within, key=lambda o: o.cost_ms)
            return pick, (f"{best.where} would stall {best.prefill.name}'s other requests "
                          f"~{best.stall_ms:.0f} ms, over the ITL target {target:g} ms")
        pick = min(stay, key=lambda o: o.stall_ms)
        return pick, f"every placement stalls over the ITL target {target:g} ms: the least"

    @staticmethod
    def _push_back(where: Where, pulled: bool, home: EngineLoad, other: EngineLoad,
                   facts: TurnFacts) -> bool:
        """Keep a copy of the history on the other engine after the turn, where it has room
        and neither engine is under pressure (the copy would cost another session its
        history), for a later turn to split computing only its delta, or move to the copy. A
        pull leaves its copy on the old home; a shared tier serves the history instead."""
        if (pulled or not facts.can_push_back or facts.shared_tier or home.pressure
                or other.pressure):
            return False
        receiver = home if where == "move" else other  # the engine left without it
        copy = tokens_to_compute(facts.prompt_tokens or 0,
                                 facts.helper_holds if where != "move"
                                 else facts.home_holds, facts.block_size) + facts.expected_output
        return receiver.fits(copy)

    @staticmethod
    def _least_waiting(options: dict[Choice, _Option], best: _Option) -> str:
        cheaper = [f"{name}: {', '.join(o.refused)}" for name, o in options.items()
                   if not o.fits and o.cost_ms < best.cost_ms]
        if cheaper:
            return f"the least waiting that may go; {'; '.join(cheaper)}"
        return "the least waiting"

    # -- the decision --------------------------------------------------------------------

    def _decision(self, option: _Option, options: dict[Choice, _Option], home: EngineLoad,
                  other: EngineLoad, facts: TurnFacts, reason: str,
                  pinned: bool = False) -> Decision:
        pulled = option.where == "move" and option.prefill is not option.home
        return Decision(
            option.where, option.home.name, option.prefill.name,
            push_back=self._push_back(option.where, pulled, home, other, facts),
            pull=pulled, pinned=pinned,
            why=f"{option.where} ({reason}): {_estimates_text(option, facts)}; waiting added: "
                + ", ".join(f"{name} ~{o.cost_ms:.0f} ms" for name, o in options.items()),
            estimates={"ttft_ms": round(option.ttft_ms, 2),
                       "stall_ms": round(option.stall_ms, 2),
                       "cost_ms": round(option.cost_ms, 2),
                       "compute_ms": round(option.compute_ms, 2),
                       # Its prompt computed, on `prefill`: a split's helper part.
                       "prefill_done_ms": round(option.prefill.prefill_wait_ms
                                                + option.held_ms + option.compute_ms, 2),
                       "home_wait_ms": round(option.home_wait_ms, 2)})


def _held_ms(engine: EngineLoad, compute_ms: float) -> float:
    """How much longer than its prompts ahead a prompt of `compute_ms` on `engine` waits, held
    back for the turns landing there (`router.landings`) until the last of those with less time
    left than that compute: the two overlap (a split's helper part is one of the prompts ahead,
    and a home's landing comes after them)."""
    latest = max((left for left in engine.landing_ms if left < compute_ms), default=0.0)
    return max(0.0, latest - engine.prefill_wait_ms)


def _stall(compute_ms: float, engine: EngineLoad) -> float:
    """How long the engine's other requests wait for a computation: not at all without any."""
    return compute_ms if engine.in_flight > 0 else 0.0


def _estimates_text(option: _Option, facts: TurnFacts) -> str:
    held = f"home holds {facts.home_holds}, helper {facts.helper_holds}"
    stall = (f", stalls {option.prefill.in_flight} other request"
             f"{'s' if option.prefill.in_flight != 1 else ''} ~{option.stall_ms:.0f} ms"
             if option.stall_ms else "")
    ahead = option.prefill.prefill_wait_ms
    queue = f" (~{ahead:.0f} ms of prompts ahead)" if ahead >= 1 else ""
    if option.held_ms >= 1:
        queue += f" (~{option.held_ms:.0f} ms held for a landing)"
    return (f"{facts.prompt_tokens} prompt tokens ({held}); prefill on {option.prefill.name}, "
            f"decode on {option.home.name}; ~{option.ttft_ms:.0f} ms to first token{queue}"
            f"{stall}")
