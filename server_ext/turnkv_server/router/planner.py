"""Where a turn runs and what moves: the `turnkv` mode's decision per turn, from measured costs
(`router.costs`).

Each session has a home, the engine of its pair that holds its history and decodes its turns;
neither engine is fixed as prefill or decode. Per turn the planner weighs:

- `whole`: the home computes what it lacks of the prompt and decodes, as an aggregated engine
  would. Nothing moves; but the home's other requests get no token while it computes. (A home
  that lost the history to memory pressure restores what its tier holds and computes the rest:
  still `whole`.)
- `split`: the other engine (the helper) computes the prompt and writes the KV the home lacks
  (the delta) into it, layer by layer, while the home goes on decoding its other sessions. The
  helper computes what its own cache lacks: only the delta where it holds a copy of the history.
- `move`: the session's home changes to the other engine: where that engine holds a copy of
  the history, it serves the turn whole from its copy (nothing crosses the link); else the
  KV is pulled from the old home (which computes the delta and writes the whole prompt's KV),
  or recomputed when the old home is down.

A placement's cost is its own time to the first token, plus the time it stalls each other
request decoding on the engine that computes, plus the turn's decode at that engine's batch:
the waiting it adds across all requests. The cheapest goes, with the ITL target as a
constraint: a placement that would stall others longer than the target is refused while one
within it is possible. A `move` must beat staying by a margin, so that sessions do not bounce.

Memory is a constraint too: a placement that would have an engine take more KV than it has
room for (`EngineLoad.room_tokens`: its cache less what the sessions' leases hold there, as the
router counts them, `Holdings`) is not taken, for it would end other sessions' leases and cost
them their histories: a split needs room on the helper for what it computes, a move room on
the new home for the whole history. Under pressure the turn so stays whole on its home, as on an
aggregated engine. And a session moves only to an engine with fewer requests in flight than
its home, and home to fewer sessions.

After a turn whose prompt the router read, the history is pushed to the other engine
(`push_back`) wherever it has room for the copy and neither engine is under memory pressure:
with a copy on both engines a later turn can run on whichever waits less, a split computing
only the delta or a move to the copy, where without one the other engine would compute the
whole history. An idle home's turn is not tokenized and pushes nothing: copies are made once a
session's engine has had others in flight. Under pressure no copy is made (a copy on both
engines halves the sessions the pair holds).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from turnkv_server.router.costs import CostModel

Where = Literal["whole", "split", "move"]
# The placements the planner weighs: a move either pulls the history over the link
# ("move") or goes to the copy a push back left on the other engine ("move-copy").
Choice = Literal["whole", "split", "move", "move-copy"]
CHOICES: tuple[Choice, ...] = ("whole", "split", "move", "move-copy")
# A move must cost this fraction less than the best placement on the home: its benefit is
# estimated from one turn, its cost (the history's KV over the link) is sure.
MOVE_MARGIN = 0.2
# Turns after a split during which the session still counts as one that splits.
SPLIT_MEMORY_TURNS = 3
# Of an engine's cache, the share leases may hold before it counts as full: the rest is
# the running requests' (their prompts and the blocks they grow into).
LEASE_SHARE = 0.9


@dataclass(frozen=True)
class EngineLoad:
    """An engine as the planner sees it when the turn is planned."""

    name: str
    healthy: bool = True
    in_flight: int = 0  # requests in flight on it, this turn's not counted
    overloaded: bool = False  # at the pool's limit of requests in flight
    pressure: bool = False  # lost a held history, or failed a push back, lately
    # Tokens of KV it can take without ending another session's lease (None: not known).
    room_tokens: int | None = None
    # Live sessions whose home it is (None: not counted).
    homed: int | None = None
    # Of its requests in flight, those whose answer has not begun: prompts it computes.
    prefilling: int = 0

    def less_busy_than(self, other: EngineLoad) -> bool:
        """Fewer prompts to compute (what a turn there waits behind), else as many and fewer
        requests in flight."""
        return (self.prefilling, self.in_flight) < (other.prefilling, other.in_flight)

    def homes_fewer_than(self, other: EngineLoad) -> bool:
        """Whether a session moving here from `other` leaves the two no further apart in
        sessions than they were (unknown counts do not stand in the way)."""
        return self.homed is None or other.homed is None or self.homed < other.homed

    def fits(self, tokens: int) -> bool:
        return self.room_tokens is None or tokens <= self.room_tokens


class Holdings:
    """What the sessions' leases hold on each engine, as the router counts it: the planner's
    view of memory pressure (`EngineLoad.room_tokens`).

    The router knows each session's history and where copies of it live (it placed every
    turn), so it can tell, without asking the engines, how much of each cache the leases hold
    and how much room is left before a new prompt would end one. The count errs high: a lease
    the engine ended under pressure, or that expired, still counts until its session ends or
    is forgotten, which makes the planner keep turns whole a little sooner than it must."""

    def __init__(self) -> None:
        self._by_session: dict[Hashable, dict[str, int]] = {}
        self._by_engine: dict[str, int] = {}

    def hold(self, session: Hashable, tokens_by_engine: Mapping[str, int]) -> None:
        """The session's leases now hold these tokens on these engines (and none elsewhere)."""
        self.drop(session)
        held = {engine: tokens for engine, tokens in tokens_by_engine.items() if tokens > 0}
        if held:
            self._by_session[session] = held
        for engine, tokens in held.items():
            self._by_engine[engine] = self._by_engine.get(engine, 0) + tokens

    def drop(self, session: Hashable) -> None:
        for engine, tokens in self._by_session.pop(session, {}).items():
            self._by_engine[engine] -= tokens

    def held(self, engine: str) -> int:
        return self._by_engine.get(engine, 0)

    def room(self, engine: str, capacity_tokens: int | None) -> int | None:
        """Tokens `engine` can take without ending a lease; None where its size is unknown."""
        if capacity_tokens is None:
            return None
        return max(0, int(capacity_tokens * LEASE_SHARE) - self.held(engine))


@dataclass(frozen=True)
class TurnFacts:
    """What the planner knows of the turn and its session."""

    # The prompt's length (None: not tokenized; the planner asked for none, `needs_prompt`).
    prompt_tokens: int | None = None
    # Leading tokens of the prompt held by the home and by the helper.
    home_holds: int = 0
    helper_holds: int = 0
    block_size: int | None = None
    expected_output: int = 0  # tokens the turn is expected to decode
    turns_since_split: int | None = None  # None: the session never split
    # The session's history after its last turn, tokens (0: none known); what a move holds
    # where the prompt is not tokenized.
    history_tokens: int = 0
    # A push back is possible: the turn's history will be known, and it is not the last.
    can_push_back: bool = False


@dataclass(frozen=True)
class Decision:
    """What the planner decided for one turn, and why."""

    where: Where
    home: str  # the engine that decodes the turn and holds the session after it
    prefill: str  # the engine that computes the prompt
    push_back: bool = False
    pull: bool = False  # a move that pulls the history from the old home
    pinned: bool = False
    why: str = ""
    estimates: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Option:
    where: Where
    prefill: EngineLoad
    home: EngineLoad
    ttft_ms: float  # to the first token
    stall_ms: float  # of each other request decoding on `prefill`
    cost_ms: float  # waiting added across all requests
    fits: bool = True  # the engines have room for the KV it adds (see the module's text)


def tokens_to_compute(prompt_len: int, held: int, block: int | None) -> int:
    """Tokens an engine holding the first `held` tokens of a `prompt_len`-token prompt
    computes: prefix caching reuses whole blocks only, and vLLM computes the last prompt token
    even when it holds it (`block` None: unknown, no tail counted)."""
    held = min(held, prompt_len - 1)
    if block:
        held = held // block * block
    return max(1, prompt_len - max(0, held))


class Planner:
    def __init__(self, costs: CostModel, itl_target_ms: float | None = None) -> None:
        self.costs = costs
        self.itl_target_ms = itl_target_ms

    @staticmethod
    def needs_prompt(home: EngineLoad, helper: EngineLoad | None, facts: TurnFacts,
                     pin: Choice | None = None) -> bool:
        """Whether the decision needs the prompt's length (a /tokenize round trip): only where
        a split could pay (the home has other requests to stall, and a helper that has fewer),
        a push back may follow (the session splits), or a placement is pinned. An idle home
        serves the turn whole: nobody waits while it computes. Nor does a split pay on a
        helper as busy as the home without a copy of the history: it would stall as many
        requests for longer, computing the whole prompt where the home computes its delta."""
        if helper is None or not helper.healthy or not home.healthy:
            return False
        return (pin is not None or home.overloaded or _splits_expected(facts)
                or helper.less_busy_than(home))

    def decide(self, home: EngineLoad, helper: EngineLoad | None, facts: TurnFacts,
               pin: Choice | None = None) -> Decision:
        """The turn's placement (`home`: the session's home, or a new session's; `helper`:
        the pair's other engine, None where there is none)."""
        other = helper if helper is not None and helper.healthy else None
        if not home.healthy:
            if other is None:
                return Decision("whole", home.name, home.name,
                                why=f"{home.name} is down and no other engine is up")
            return Decision("move", other.name, other.name, why=(
                f"{home.name} is down: moved to {other.name}, which recomputes the history"))
        if other is None:
            return Decision("whole", home.name, home.name, why="no other engine is up")
        if facts.prompt_tokens is None:
            if home.overloaded and not other.overloaded and other.fits(facts.history_tokens):
                return self._pull(home, other, f"{home.name} is overloaded")
            why = (f"{home.name} has nothing in flight to stall" if not home.in_flight else
                   f"{other.name} is as busy as {home.name}: a split cannot pay")
            return Decision("whole", home.name, home.name, push_back=self._push_back(
                "whole", False, home, other, facts), why=why)
        options = self._options(home, other, facts)
        if pin is not None:
            # No copy to move to: the move pulls the history instead.
            pinned = options.get(pin) or options["move"]
            return self._decision(pinned, options, home, other, facts, "pinned", pinned=True)
        moves = [o for o in (options["move"], options.get("move-copy")) if o and o.fits]
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
        # Whole: the home computes what it lacks, stalling its other requests meanwhile.
        whole_n = tokens_to_compute(prompt, facts.home_holds, block)
        whole_ms = costs.prefill_ms(home.name, prompt, whole_n)
        home_decode = out * costs.decode_step_ms(home.name, home.in_flight + 1)
        whole = _Option("whole", home, home, whole_ms, _stall(whole_ms, home),
                        whole_ms * (1 + home.in_flight) + home_decode)
        # Split: the helper computes what it lacks and writes what the home lacks.
        split_n = tokens_to_compute(prompt, facts.helper_holds, block)
        split_compute = costs.prefill_ms(other.name, prompt, split_n)
        split_ms = (split_compute + costs.transfer_ms(whole_n)
                    + costs.priors.split_overhead_ms)
        split = _Option("split", other, home, split_ms, _stall(split_compute, other),
                        split_ms + split_compute * other.in_flight + home_decode,
                        fits=other.fits(split_n))
        # Move, pulling: the old home computes the delta and writes the whole prompt's KV to
        # the other engine, which decodes there from now on, at its own batch.
        move_ms = whole_ms + costs.transfer_ms(prompt) + costs.priors.split_overhead_ms
        moved_decode = out * costs.decode_step_ms(other.name, other.in_flight + 1)
        options: dict[Choice, _Option] = {"whole": whole, "split": split}
        if facts.helper_holds:
            # Move, to the copy: the other engine holds the history (a push back left it
            # there), so it serves the turn whole, computing what its copy lacks, and
            # nothing crosses the link at the turn. A whole turn of the other engine's.
            copy_ms = costs.prefill_ms(other.name, prompt, split_n)
            options["move-copy"] = _Option(
                "move", other, other, copy_ms, _stall(copy_ms, other),
                copy_ms * (1 + other.in_flight) + moved_decode,
                fits=other.fits(split_n + out) and other.less_busy_than(home))
        # Only to a less busy engine: a decode step measured at a small batch includes the
        # steps that prefills held, so by its costs alone an engine measured while it started
        # its first prompts reads slower than a crowded one, and sessions would drain to it.
        # Nor to one home to as many sessions: requests in flight are a moment's load, the
        # sessions homed the load to come; a move that leaves one engine home to more
        # sessions than the other is paid back on every later turn of theirs.
        options["move"] = _Option(
            "move", home, other, move_ms, _stall(whole_ms, home),
            move_ms + whole_ms * home.in_flight + moved_decode,
            fits=(other.fits(prompt + out) and other.less_busy_than(home)
                  and other.homes_fewer_than(home)))
        return options

    def _choose(self, options: dict[Choice, _Option]) -> tuple[_Option, str]:
        stay = [o for o in (options["whole"], options["split"]) if o.fits]
        best = min(stay, key=lambda o: o.cost_ms)
        moves = [o for o in (options.get("move-copy"), options["move"]) if o and o.fits]
        move = min(moves, key=lambda o: o.cost_ms) if moves else None
        if move is not None and move.cost_ms < best.cost_ms * (1 - MOVE_MARGIN):
            best = move
        target = self.itl_target_ms
        if target is None or best.stall_ms <= target:
            return best, self._least_waiting(options, best)
        within = [o for o in (*stay, *moves) if o.stall_ms <= target]
        if within:
            pick = min(within, key=lambda o: o.cost_ms)
            return pick, (f"{best.where} would stall {best.prefill.name}'s other requests "
                          f"~{best.stall_ms:.0f} ms, over the ITL target {target:g} ms")
        pick = min(stay, key=lambda o: o.stall_ms)
        return pick, f"every placement stalls over the ITL target {target:g} ms: the least"

    @staticmethod
    def _least_waiting(options: dict[Choice, _Option], best: _Option) -> str:
        cheaper = [name for name, o in options.items()
                   if not o.fits and o.cost_ms < best.cost_ms]
        if cheaper:
            return f"the least waiting with room: {' and '.join(cheaper)} would end leases"
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
                       "cost_ms": round(option.cost_ms, 2)})

    def _pull(self, home: EngineLoad, other: EngineLoad, reason: str) -> Decision:
        return Decision("move", other.name, home.name, pull=True,
                        why=f"move ({reason}): {home.name} computes the delta and writes the "
                            f"history to {other.name}")

    @staticmethod
    def _push_back(where: Where, pulled: bool, home: EngineLoad, other: EngineLoad,
                   facts: TurnFacts) -> bool:
        """Keep a copy of the history on the pair's other engine after the turn, wherever it
        has room for it and neither engine is under memory pressure (there the copy would
        cost another session its history): with a copy there, a later turn can run on
        whichever engine waits less (a split computing only its delta, or a move to the
        copy), where without one the other engine would compute the whole history. A move
        that pulled leaves its copy on the old home."""
        if pulled or not facts.can_push_back or home.pressure or other.pressure:
            return False
        receiver = home if where == "move" else other  # the engine left without it
        copy = tokens_to_compute(facts.prompt_tokens or facts.history_tokens,
                                 facts.helper_holds if where != "move"
                                 else facts.home_holds, facts.block_size) + facts.expected_output
        return receiver.fits(copy)


def _splits_expected(facts: TurnFacts) -> bool:
    return facts.turns_since_split is not None and \
        facts.turns_since_split < SPLIT_MEMORY_TURNS


def _stall(compute_ms: float, engine: EngineLoad) -> float:
    """How long the engine's other requests wait for a computation: not at all without any."""
    return compute_ms if engine.in_flight > 0 else 0.0


def _estimates_text(option: _Option, facts: TurnFacts) -> str:
    held = f"home holds {facts.home_holds}, helper {facts.helper_holds}"
    stall = (f", stalls {option.prefill.in_flight} other request"
             f"{'s' if option.prefill.in_flight != 1 else ''} ~{option.stall_ms:.0f} ms"
             if option.stall_ms else "")
    return (f"{facts.prompt_tokens} prompt tokens ({held}); prefill on {option.prefill.name}, "
            f"decode on {option.home.name}; ~{option.ttft_ms:.0f} ms to first token{stall}")
