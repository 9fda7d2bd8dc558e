"""Where a turn runs and what moves: the `turnkv` mode's decision per turn, from measured costs (the
cost model, `CostModel`, below). Each session has a home, the engine of its pair that holds its
history and decodes its turns; neither engine is fixed as prefill or decode. Per turn the planner
places it whole on the home, split (the other engine computes, the home decodes) or moved
(`decisions.Where`, which says what each moves).

Where the prompt's length is known, each placement is weighed by its cost, under the engines' room
for its KV, and a copy may be pushed back after it (`router.weighing`); a turn not read is served
whole on its home, or moved from an overloaded one, and keeps no copy.

The cost model (`CostModel`): what serving costs on each engine, as the turns measure it, fed once
per served turn and read once per planned turn, in memory. Each figure is an exponentially weighted
mean per engine and bucket (online, bounded, following the load); a bucket not measured yet takes
the nearest measured one of the engine's, then the prior.
- prefill: the engine's own timing of the request that computed a prompt (vLLM's per-request
  `engine_prefill_ms`) over the tokens it computed, by the prompt's length (attention makes a long
  context's token dearer); it includes the decode steps its steps carried;
- decode: the turn's time after its first token per token, by the engine's batch as the turn ends
  (streamed turns only, which time their first token);
- a prompt: the engine's timing of a prompt, whatever its length (`prompt_ms`): what a prompt
  neither read nor estimated counts as;
- a tier read: per token read from the engine's tier, its timing less computing the rest there;
- a split's tail: from the helper's answer to the home's first token, less the transfer;
- transfer: tokens of KV per ms between engines, a setting (`--transfer-tokens-per-ms`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from itertools import islice

from turnkv_server.router.decisions import Choice, Decision, Priors, TurnFacts

SPLIT_MEMORY_TURNS = 3  # turns after a split during which a session counts as one that splits
# Of an engine's cache, the share leases may hold before it counts as full: the rest is its
# running requests' (their prompts and the blocks they grow into).
LEASE_SHARE = 0.9
BUSIER_QUEUE = 0.5  # its prompts ahead done in under this share of another's: the less busy
MAX_TURNS_IN_FLIGHT = 10_000  # counted at most: a backstop for turns that never end


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
    # Tokens of KV its cache holds (None: not known); as the router counts its turns in
    # flight (`TurnsInFlight`), the KV they hold and the ms of prompts ahead of a new one.
    capacity_tokens: int | None = None
    kv_in_flight: int = 0
    prefill_wait_ms: float = 0.0
    landing_ms: tuple[float, ...] = ()  # the time left to turns landing on it (`Landings`)

    def less_busy_than(self, other: EngineLoad) -> bool:
        """Its prompts ahead done in under half the other's time (as estimated, which errs by
        less: one long prompt is no short one), else fewer prompts, else fewer requests."""
        waits = sorted((self.prefill_wait_ms, other.prefill_wait_ms))
        if waits[0] < waits[1] * BUSIER_QUEUE:
            return self.prefill_wait_ms < other.prefill_wait_ms
        return (self.prefilling, self.in_flight) < (other.prefilling, other.in_flight)

    def homes_fewer_than(self, other: EngineLoad, slack: int = 0) -> bool:
        """Whether a session moving here leaves the two no further apart in sessions (with
        `slack` 1: it leaves this one home to at most two more than the other)."""
        return self.homed is None or other.homed is None or self.homed < other.homed + slack

    def fits(self, tokens: int) -> bool:
        return self.room_tokens is None or tokens <= self.room_tokens

    def waits_for_room(self, tokens: int) -> bool:
        """Whether `tokens` of KV would wait for its requests in flight to end."""
        return (self.capacity_tokens is not None
                and self.kv_in_flight + tokens > self.capacity_tokens)

    def fits_cache(self, tokens: int) -> bool:
        """Whether `tokens` fit in its cache, ending leases (their KV is in a shared tier)."""
        return self.capacity_tokens is None or tokens <= self.capacity_tokens


class Holdings:
    """What the sessions' leases hold on each engine, counted from the placements (the router
    placed every turn): the planner's view of memory pressure (`EngineLoad.room_tokens`). It
    errs high: a lease an engine ended counts until its session ends or is forgotten."""

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
class _TurnInFlight:
    home: str
    kv_tokens: int
    prefill: str
    prefill_ms: float
    at_s: float
    shared: bool  # sent while its engine had another prompt unanswered
    held: bool = False  # not sent yet: held back while a turn lands there (`Landings`)


class TurnsInFlight:
    """What each engine's turns in flight hold and owe, as the router counts them: a turn's KV
    (prompt and expected output) on the engine that decodes it, and its prompt's estimated
    compute on the engine that computes it (`EngineLoad`), from plan (`held` back until `sent`)
    to end. One whose end is never told (an attempt replanned) goes when its engine idles."""

    def __init__(self, max_turns: int = MAX_TURNS_IN_FLIGHT) -> None:
        self._turns: dict[Hashable, _TurnInFlight] = {}  # bounded: at most `max_turns`
        self._kv: dict[str, int] = {}
        # By engine, the turns it decodes, and those whose prompts it computes: oldest first.
        self._homed: dict[str, dict[Hashable, None]] = {}
        self._computing: dict[str, dict[Hashable, None]] = {}
        self._max_turns = max_turns

    def begin(self, turn: Hashable, home: str, kv_tokens: int, prefill: str | None = None,
              prefill_ms: float = 0.0, at_s: float = 0.0, shared: bool = False,
              held: bool = False) -> None:
        self.end(turn)
        while len(self._turns) >= self._max_turns:
            self.end(next(iter(self._turns)))
        record = _TurnInFlight(home, kv_tokens, prefill or home, prefill_ms, at_s, shared, held)
        self._turns[turn] = record
        self._kv[home] = self._kv.get(home, 0) + kv_tokens
        self._homed.setdefault(home, {})[turn] = None
        self._computing.setdefault(record.prefill, {})[turn] = None

    def end(self, turn: Hashable) -> bool:
        """Whether it was `shared`: sent while its engine had another prompt unanswered."""
        record = self._turns.pop(turn, None)
        if record is not None:
            self._kv[record.home] -= record.kv_tokens
            self._homed[record.home].pop(turn, None)
            self._computing[record.prefill].pop(turn, None)
        return record is not None and record.shared

    def sent(self, turn: Hashable, at_s: float, shared: bool) -> None:
        if turn in self._turns:  # a turn `held` back is sent now
            self._turns[turn] = replace(self._turns[turn], at_s=at_s, shared=shared, held=False)

    def idle(self, engine: str) -> None:
        """`engine` has no request in flight: none of its turns sent holds KV or computes there."""
        for turn in [*self._homed.get(engine, ()), *self._computing.get(engine, ())]:
            if turn in self._turns and not self._turns[turn].held:
                self.end(turn)

    def kv_tokens(self, engine: str) -> int:
        return self._kv.get(engine, 0)

    def prefill_wait_ms(self, engine: str, pending: int, now_s: float,
                        answered_ago_s: float = math.inf) -> float:
        """The compute ahead of a prompt placed on `engine` now: the estimates of its `pending`
        newest prompts sent (its requests whose answer has not begun: prompts are computed first
        come first served), in full but the oldest's, computed since it was placed or the
        engine's last answer began (`answered_ago_s`), if later; and those held back, in full:
        one is sent at the latest when it has waited its own compute, and a prompt then passed
        over for a step (a tier read pending, or itself held) waits for all of it."""
        turns = [self._turns[turn] for turn in self._computing.get(engine, {})]
        held_ms = sum(t.prefill_ms for t in turns if t.held)
        ahead = list(islice(reversed([t for t in turns if not t.held]), max(0, pending)))
        if not ahead:
            return held_ms
        since = min(now_s - ahead[-1].at_s, answered_ago_s)
        return (held_ms + max(0.0, ahead[-1].prefill_ms - since * 1000)
                + sum(t.prefill_ms for t in ahead[:-1]))


def tokens_to_compute(prompt_len: int, held: int, block: int | None) -> int:
    """Tokens an engine holding the first `held` of a `prompt_len`-token prompt computes: whole
    blocks only are reused, and the last token always computed (`block` None: unknown)."""
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
        """Whether the decision needs the prompt's length (a /tokenize round trip): a placement
        pinned, or a busy home and a split that could pay (a helper less busy) or a push back to
        follow (the session splits). An idle home serves it whole (none is sooner; unread, it
        pushes no copy back); a helper as busy would stall as many for longer."""
        if helper is None or not helper.healthy or not home.healthy:
            return False
        since_split = facts.turns_since_split
        splits = since_split is not None and since_split < SPLIT_MEMORY_TURNS
        return (pin is not None or home.overloaded
                or (home.in_flight > 0 and (helper.less_busy_than(home) or splits)))

    def decide(self, home: EngineLoad, helper: EngineLoad | None, facts: TurnFacts,
               pin: Choice | None = None) -> Decision:
        """The turn's placement (`home`: the session's home, or a new session's; `helper`: the
        pair's other engine, None where there is none), with its prompt's estimated compute
        (`estimates["compute_ms"]`; unread: its estimate's tokens lacked, else `prompt_ms`)."""
        decision = self._decide(home, helper, facts, pin)
        guess, engine = facts.prompt_estimate, decision.prefill
        held = facts.history_tokens if engine == home.name else 0  # else a recompute
        decision.estimates.setdefault("compute_ms", self.costs.prefill_ms(
            engine, guess, tokens_to_compute(guess, held, None)) if guess
            else self.costs.prompt_ms(engine))
        return decision

    def _decide(self, home: EngineLoad, helper: EngineLoad | None, facts: TurnFacts,
                pin: Choice | None) -> Decision:
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
                return Decision("move", other.name, home.name, pull=True, why=(
                    f"move ({home.name} is overloaded): {home.name} computes the delta and "
                    f"writes the history to {other.name}"))
            why = (f"{home.name} has nothing in flight to stall" if not home.in_flight else
                   f"{other.name} is as busy as {home.name}: a split cannot pay")
            return Decision("whole", home.name, home.name, why=why)
        return self._weigh(home, other, facts, pin)

    def _weigh(self, home: EngineLoad, other: EngineLoad, facts: TurnFacts,
               pin: Choice | None) -> Decision:
        raise NotImplementedError  # a read prompt's placements by cost: `WeighingPlanner`


# -- the cost model -------------------------------------------------------------------------

# Weight of a new measurement: the mean follows a change of load within about ten turns, and
# one odd turn (a preemption, a cold cache) moves it by a fifth.
EWMA_WEIGHT = 0.2
# Context-length buckets: powers of two from this many tokens up (below: the first bucket).
FIRST_CONTEXT_BUCKET = 256
MAX_CONTEXT_BUCKET = 1 << 20
# Prompts computing fewer tokens than this teach no cost per token (a step's fixed cost).
MIN_PREFILL_TOKENS = 16


def context_bucket(tokens: int) -> int:
    """The bucket of a prompt of `tokens` tokens: the power of two at or above it."""
    return min(MAX_CONTEXT_BUCKET, max(FIRST_CONTEXT_BUCKET, 1 << max(0, tokens - 1).bit_length()))


def batch_bucket(in_flight: int) -> int:
    """The bucket of `in_flight` requests: 1, 2, 4, 8, ... (a step costs far less than linearly)."""
    return 1 << max(0, in_flight - 1).bit_length()


class Ewma:
    """Exponentially weighted means by bucket."""

    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        self._weight = weight
        self._means: dict[int, float] = {}

    def add(self, bucket: int, value: float) -> None:
        mean = self._means.get(bucket)
        self._means[bucket] = value if mean is None else mean + self._weight * (value - mean)

    def nearest(self, bucket: int) -> float | None:
        """The bucket's mean, else the nearest measured bucket's (on a log scale), else None."""
        if bucket in self._means or not self._means:
            return self._means.get(bucket)
        near = min(self._means, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self._means[near]


class CostModel:
    """Per engine: prefill ms per token by context, ms per prompt, decode ms per step by batch,
    tier read ms per token, a split's tail ms (one bucket each of the last three)."""

    def __init__(self, priors: Priors | None = None) -> None:
        self.priors = priors or Priors()
        self._prefill: dict[str, Ewma] = {}
        self._decode: dict[str, Ewma] = {}
        self._prompt: dict[str, Ewma] = {}
        self._tier_read: dict[str, Ewma] = {}
        self._split_tail: dict[str, Ewma] = {}

    def observe_prefill(self, engine: str, prompt_tokens: int, computed: int | None,
                        engine_ms: float | None, restored: int = 0, shared: bool = False) -> None:
        """`engine` computed `computed` tokens of a `prompt_tokens`-token prompt and read
        `restored` from its tier in `engine_ms` (None: not reported). A few tokens are mostly a
        step's fixed cost: they count for `prompt_ms` only; a read took what computing the rest
        would not have, once computing is measured. A `shared` prompt (sent while another was
        unanswered) may be timed with the other's steps: an upper bound, taught below the mean."""
        if engine_ms is None or engine_ms < 0:
            return
        _add(self._prompt, engine, 0, engine_ms, shared)
        if restored > 0:
            if self.measured(engine):
                compute_ms = self.prefill_ms(engine, prompt_tokens, computed or 0)
                _add(self._tier_read, engine, 0, max(0.0, engine_ms - compute_ms) / restored,
                     shared)
        elif computed is not None and computed >= MIN_PREFILL_TOKENS:
            _add(self._prefill, engine, context_bucket(prompt_tokens), engine_ms / computed,
                 shared)

    def observe_split_tail(self, home: str, tail_ms: float, received: int,
                           ahead_ms: float = 0.0) -> None:
        """A split's first token came `tail_ms` after its helper answered, `received` tokens of
        KV written into `home`, `ahead_ms` of its prompts still ahead of the turn then: the rest
        is the split's fixed cost."""
        if tail_ms >= 0:
            fixed = tail_ms - self.transfer_ms(received) - max(0.0, ahead_ms)
            _add(self._split_tail, home, 0, max(0.0, fixed))

    def observe_decode(self, engine: str, batch: int, first_token_ms: float | None,
                       total_ms: float, completion_tokens: int) -> None:
        """A turn decoded `completion_tokens` tokens on `engine` among `batch` requests in
        flight, its first at `first_token_ms`, its last at `total_ms` (from the turn's start)."""
        if first_token_ms is None or completion_tokens < 2 or total_ms < first_token_ms:
            return
        step = (total_ms - first_token_ms) / (completion_tokens - 1)
        _add(self._decode, engine, batch_bucket(max(1, batch)), step)

    def prefill_ms_per_token(self, engine: str, context_tokens: int) -> tuple[float, bool]:
        """(ms per computed token of a `context_tokens` prompt on `engine`, measured)."""
        mean = _mean(self._prefill, engine, context_bucket(context_tokens))
        return (self.priors.prefill_ms_per_token, False) if mean is None else (mean, True)

    def prefill_ms(self, engine: str, context_tokens: int, computed: int) -> float:
        return computed * self.prefill_ms_per_token(engine, context_tokens)[0]

    def prompt_ms(self, engine: str) -> float:
        """A prompt's compute on `engine`, as its prompts measured it (0 before any)."""
        return _mean(self._prompt, engine, 0) or 0.0

    def decode_step_ms(self, engine: str, batch: int) -> float:
        mean = _mean(self._decode, engine, batch_bucket(max(1, batch)))
        return self.priors.decode_step_ms if mean is None else mean

    def transfer_ms(self, tokens: int) -> float:
        return tokens / self.priors.transfer_tokens_per_ms

    def tier_read_ms(self, engine: str, tokens: int) -> float:
        mean = _mean(self._tier_read, engine, 0)
        return tokens / self.priors.tier_read_tokens_per_ms if mean is None else tokens * mean

    def split_overhead_ms(self, home: str) -> float:
        """A split's fixed cost on `home`: its tail beyond the transfer, as measured."""
        mean = _mean(self._split_tail, home, 0)
        return self.priors.split_overhead_ms if mean is None else mean

    def measured(self, engine: str) -> bool:
        """Whether `engine` has measured a prefill yet."""
        return engine in self._prefill


def _add(table: dict[str, Ewma], engine: str, bucket: int, value: float,
         upper_bound: bool = False) -> None:
    """`upper_bound`: the cost was at most `value`, which teaches only below the mean."""
    if upper_bound and not value < (_mean(table, engine, bucket) or 0.0):
        return
    table.setdefault(engine, Ewma()).add(bucket, value)


def _mean(table: dict[str, Ewma], engine: str, bucket: int) -> float | None:
    return table[engine].nearest(bucket) if engine in table else None
