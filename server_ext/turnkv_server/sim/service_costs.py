"""What serving costs in the simulated fleet: parametric curves, fitted from `turnkv bench`
results (`calibration`) or derived from published figures (`gpu_profiles`).

- prefill: `fixed + computed x per_token + per_token_per_kctx x keys / 1000` ms: a step's
  fixed cost, a cost per computed token, and attention, per key each computed token attends
  to (`keys`: the computed tokens are the prompt's last, and a token at position p attends
  to the p before it, as `bench.estimate.sum_keys` counts them). A whole prompt's tokens
  attend to half its length on average, a short delta's to all of it: charging every
  computed token the whole prompt would charge a long recompute twice its attention;
- decode: `fixed + per_seq x batch` ms per step (a step reads the weights once, and each
  sequence's KV);
- transfer and tier reads: tokens of KV per ms;
- a routing's own work per turn (`routing_overhead_ms`: the router's and the connector's, on
  top of what the engines compute), added to each of its turns' time to the first token;
- a prompt reaching an engine that decodes other turns: the rest of the step in progress
  (`SimEngine.steps_to_join_ms`), and `join_wait_steps` more decode steps (on an engine with a
  host tier `tier_join_wait_steps`): what such prompts took on the bench's engines beyond
  that, fitted (`calibration.fit_join_wait`), not modelled step by step;
- a host tier's stores: `tier_store_ms_per_block` more for each step of an engine that copies
  a block (`block_size` tokens) new to its tier, paced a block a step (`SimEngine.store`):
  on a CPU the copy runs on the engine's core inside its step (`calibration.fit_store_cost`);
  on a GPU a copy stream runs it beside the steps (0).

The planner's own cost model (`router.planner.CostModel`) starts from `planner_priors()` and
learns per engine from the simulated turns as the router does from real ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from turnkv_server.bench.estimate import sum_keys
from turnkv_server.router.decisions import Priors

# The context at which `planner_priors` quotes a cost per token: a mid-length prompt.
_PRIOR_CONTEXT = 2048


def attended_keys(computed: int, context: int) -> float:
    """Keys the last `computed` tokens of a `context`-token prompt attend to, summed."""
    return sum_keys(max(0, context - computed), context)


@dataclass(frozen=True)
class ServiceCosts:
    name: str
    prefill_fixed_ms: float
    prefill_ms_per_token: float
    prefill_ms_per_token_per_kctx: float
    decode_fixed_ms: float
    decode_ms_per_seq: float
    transfer_tokens_per_ms: float
    tier_tokens_per_ms: float
    kv_capacity_tokens: int  # one engine's KV cache
    block_size: int
    kv_bytes_per_token: int
    split_overhead_ms: float = 5.0
    # vLLM's chunked prefill: a step computes at most this many prompt tokens beside its
    # decodes (`max_num_batched_tokens`).
    prefill_chunk_tokens: int = 2048
    source: str = ""
    # Per routing (`affinity`, `standard`, `turnkv`), ms a turn spends in the routing's own
    # work beyond what its engines compute; a routing not named spends none.
    routing_overhead_ms: Mapping[str, float] = field(default_factory=dict)
    # Decode steps a prompt reaching an engine that decodes other turns waits beyond the rest
    # of the step in progress, on an engine without a host tier and on one with one.
    join_wait_steps: float = 0.0
    tier_join_wait_steps: float = 0.0
    # Ms a step of an engine with a host tier takes longer for the block it copies there.
    tier_store_ms_per_block: float = 0.0

    def prefill_ms(self, computed: int, context: int) -> float:
        """Computing the last `computed` tokens of a `context`-token prompt."""
        if computed <= 0:
            return 0.0
        return (self.prefill_fixed_ms + computed * self.prefill_ms_per_token
                + self.prefill_ms_per_token_per_kctx * attended_keys(computed, context) / 1000)

    def decode_step_ms(self, batch: int) -> float:
        return self.decode_fixed_ms + self.decode_ms_per_seq * max(1, batch)

    def transfer_ms(self, tokens: int) -> float:
        return tokens / self.transfer_tokens_per_ms if tokens > 0 else 0.0

    def tier_read_ms(self, tokens: int) -> float:
        return tokens / self.tier_tokens_per_ms if tokens > 0 else 0.0

    def join_wait(self, tier: bool) -> float:
        """`join_wait_steps` for an engine with a host tier (`tier`) or without."""
        return self.tier_join_wait_steps if tier else self.join_wait_steps

    def turn_overhead_ms(self, routing: str) -> float:
        return self.routing_overhead_ms.get(routing, 0.0)

    def planner_priors(self) -> Priors:
        """The planner's cold-start costs, from these curves."""
        return Priors(prefill_ms_per_token=self.prefill_ms(1000, _PRIOR_CONTEXT) / 1000,
                      decode_step_ms=self.decode_step_ms(1),
                      transfer_tokens_per_ms=self.transfer_tokens_per_ms,
                      split_overhead_ms=self.split_overhead_ms)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
