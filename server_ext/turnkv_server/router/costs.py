"""What serving costs on each engine, as the turns measure it: the planner's (`router.planner`)
cost model.

Fed once per served turn (`observe_*`), read once per planned turn; pure and in memory, so that
the router's own cost per turn stays within its budget. Each figure is an exponentially weighted
mean per engine and per bucket (context length for prefill, batch for decode): online, bounded
(a handful of buckets per engine) and following the load as it changes.

- prefill: the engine's own timing of the request that computed a prompt
  (`times.engine_prefill_ms`, vLLM's per-request metrics) over the tokens it computed, by the
  prompt's length, since attention makes a token of a long context dearer. It includes the
  other requests' decode steps sharing those steps, so it is what their tokens waited too;
- decode: the turn's time after its first token over its tokens after the first, by the
  engine's requests in flight as the turn ends (its batch; streamed turns only, which time
  their first token);
- transfer: tokens of KV per ms between engines. No turn's stats time a transfer (the engines
  report what moved, not how long it took), so this is a setting (`--transfer-tokens-per-ms`),
  not a measurement.

Until a bucket has a measurement, the nearest measured bucket of the same engine answers (a
cost per token varies by a small factor across context lengths, by orders across hardware),
then the prior (`Priors`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of a new measurement: the mean follows a change of load within about ten turns, and
# one odd turn (a preemption, a cold cache) moves it by a fifth.
EWMA_WEIGHT = 0.2
# Context-length buckets: powers of two from this many tokens up (below: the first bucket).
FIRST_CONTEXT_BUCKET = 256
MAX_CONTEXT_BUCKET = 1 << 20
# Prompts computing fewer tokens than this teach no cost per token (a step's fixed cost).
MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True)
class Priors:
    """The costs assumed before an engine has measured anything (cold start).

    The planner compares placements of one turn over the same engines, so what decides on a
    cold start is the ratio of the token counts and of the requests each placement would stall,
    which the prior's scale does not change; its scale matters only against the fixed costs of
    a split (its overhead and transfer). Both engines start equal, and a few turns replace the
    prior with what they measured. The values are those of a mid-sized model on one GPU: a
    prefill of a few thousand tokens per second with other sessions decoding beside it, a
    decode step of tens of ms, KV moving at tens of tokens per ms over the engines' link."""

    prefill_ms_per_token: float = 0.2
    decode_step_ms: float = 30.0
    transfer_tokens_per_ms: float = 50.0
    # A split's fixed cost: a second request, the receiver's registration and the first
    # layer's write before the home can step.
    split_overhead_ms: float = 5.0


def context_bucket(tokens: int) -> int:
    """The bucket of a prompt of `tokens` tokens: the power of two at or above it."""
    bucket = FIRST_CONTEXT_BUCKET
    while bucket < tokens and bucket < MAX_CONTEXT_BUCKET:
        bucket <<= 1
    return bucket


def batch_bucket(in_flight: int) -> int:
    """The bucket of a batch of `in_flight` requests: 1, 2, 4, 8, ... (a step's cost grows with
    the batch by far less than in proportion)."""
    bucket = 1
    while bucket < in_flight:
        bucket <<= 1
    return bucket


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
        if bucket in self._means:
            return self._means[bucket]
        if not self._means:
            return None
        near = min(self._means, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self._means[near]


class CostModel:
    """Per engine: prefill ms per computed token by context length, decode ms per step by
    batch; and the transfer rate between engines."""

    def __init__(self, priors: Priors | None = None) -> None:
        self.priors = priors or Priors()
        self._prefill: dict[str, Ewma] = {}
        self._decode: dict[str, Ewma] = {}

    def observe_prefill(self, engine: str, prompt_tokens: int, computed: int | None,
                        engine_ms: float | None) -> None:
        """`engine` computed `computed` tokens of a `prompt_tokens`-token prompt in
        `engine_ms` (None: not reported). A prompt of a few tokens is mostly a step's fixed
        cost, not a cost per token: it is not counted."""
        if computed is None or engine_ms is None or computed < MIN_PREFILL_TOKENS \
                or engine_ms < 0:
            return
        self._prefill.setdefault(engine, Ewma()).add(context_bucket(prompt_tokens),
                                                     engine_ms / computed)

    def observe_decode(self, engine: str, batch: int, first_token_ms: float | None,
                       total_ms: float, completion_tokens: int) -> None:
        """A turn decoded `completion_tokens` tokens on `engine` among `batch` requests in
        flight, its first at `first_token_ms`, its last at `total_ms` (both from the turn's
        start)."""
        if first_token_ms is None or completion_tokens < 2 or total_ms < first_token_ms:
            return
        step = (total_ms - first_token_ms) / (completion_tokens - 1)
        self._decode.setdefault(engine, Ewma()).add(batch_bucket(max(1, batch)), step)

    def prefill_ms_per_token(self, engine: str, context_tokens: int) -> tuple[float, bool]:
        """(ms per computed token of a `context_tokens` prompt on `engine`, measured)."""
        found = self._prefill.get(engine)
        mean = found.nearest(context_bucket(context_tokens)) if found else None
        return (self.priors.prefill_ms_per_token, False) if mean is None else (mean, True)

    def prefill_ms(self, engine: str, context_tokens: int, computed: int) -> float:
        return computed * self.prefill_ms_per_token(engine, context_tokens)[0]

    def decode_step_ms(self, engine: str, batch: int) -> float:
        found = self._decode.get(engine)
        mean = found.nearest(batch_bucket(max(1, batch))) if found else None
        return self.priors.decode_step_ms if mean is None else mean

    def transfer_ms(self, tokens: int) -> float:
        return tokens / self.priors.transfer_tokens_per_ms

    def measured(self, engine: str) -> bool:
        """Whether `engine` has measured a prefill yet."""
        return engine in self._prefill
