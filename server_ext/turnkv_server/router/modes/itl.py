"""The decode engine's inter-token-latency target (`--itl-target-ms`, `turnkv` mode).

A short delta computed on the decode engine shares that engine's steps with its other sessions'
decoding: while it is computed they get no token (measured on the agent workload: ITL p99 2.28 s,
against 0.2-0.3 s for a decode engine that only decodes). With a target, the decode engine
computes a short delta only while the stall it would cause stays within it:

- with no other request in flight on the decode engine, nobody waits: the delta stays there;
- otherwise the stall is estimated as the tokens the engine would compute (the delta, plus the
  tail of the history's last KV block, which prefix caching does not hold) times that engine's
  measured prefill cost per token; over the target, the prefill engine computes the turn and
  its KV is transferred, as for a long turn.

The cost per token is learnt per decode engine from its last `WINDOW` short deltas: their
engine-timed prefill (`times.engine_prefill_ms`, vLLM's per-request metrics) over the tokens
they computed. It includes the other sessions' decoding in the same steps, so it is what their
tokens waited, and it errs high for deltas longer than those measured (a step's fixed cost
counted per token): the safe side. Until an engine has a measurement, a delta that would share
it with other requests goes to the prefill engine (the idle engine's deltas teach it). The
delta is not chunked: a delta is computed whole, or not at all, on the decode engine.
"""

from __future__ import annotations

from collections import deque

# Short deltas per decode engine the cost per token is measured over: enough that one odd step
# (a preemption, a cold cache) does not swing it, few enough to follow the load.
WINDOW = 16


class ItlTarget:
    """Per decode engine, its measured prefill cost per token, and whether a short delta stays
    on it (`divert`)."""

    def __init__(self, target_ms: float | None) -> None:
        self.target_ms = target_ms  # None: no target, every short delta stays
        # Decode engine name -> (engine_prefill_ms, tokens computed) of its last short deltas.
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, engine: str, engine_ms: float | None, computed: int | None) -> None:
        """A short delta the decode engine `engine` computed: `computed` tokens in `engine_ms`
        (None where the engine did not report it)."""
        if engine_ms is None or computed is None or computed <= 0 or engine_ms < 0:
            return
        self._samples.setdefault(engine, deque(maxlen=WINDOW)).append((engine_ms, computed))

    def cost_per_token_ms(self, engine: str) -> float | None:
        """The window's prefill time over its tokens (weighted by tokens, so that a short
        delta of a few tokens, mostly a step's fixed cost, does not dominate)."""
        samples = self._samples.get(engine)
        if not samples:
            return None
        return sum(ms for ms, _ in samples) / sum(tokens for _, tokens in samples)

    def divert(self, engine: str, tokens: int, others: int) -> str | None:
        """Why a short delta of `tokens` to compute should go to the prefill engine rather
        than to the decode engine `engine`, which has `others` requests in flight besides
        this turn; None: the decode engine computes it."""
        if self.target_ms is None or others <= 0:
            return None
        cost = self.cost_per_token_ms(engine)
        requests = f"{others} other request{'s' if others > 1 else ''}"
        if cost is None:
            return (f"ITL target {self.target_ms:g} ms: {engine} has {requests} in flight and "
                    f"no measured prefill cost yet, so the prefill engine computed the delta "
                    f"({tokens} tokens)")
        stall = tokens * cost
        if stall <= self.target_ms:
            return None
        return (f"ITL target {self.target_ms:g} ms: computing the delta on {engine} ({tokens} "
                f"tokens at {cost:.2f} ms each) would stall its {requests} about "
                f"{stall:.0f} ms, so the prefill engine computed it")
