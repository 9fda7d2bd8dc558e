"""One simulated engine: a prefill lane, decoding by processor sharing, its KV cache and tier.

Decoding is not one event per token: the engine keeps a clock of decode steps, advancing at
one step per `decode_step_ms(batch)`. While a prefill runs, each step also computes one chunk
of it (vLLM's chunked prefill: `prefill_chunk_tokens` per step), so a step takes the longer of
a decode step and the prefill's time per chunk (a prefill's cost, calibrated, already includes
the decode work that shares its steps). A turn that decodes n tokens finishes when the clock
has advanced n steps from its start; only the next finish is scheduled, and rescheduled when
the batch or the step changes. A prompt that reaches an engine while it decodes joins the
next step: it waits for the one in progress to end, and the fitted steps beyond
(`steps_to_join_ms`).

An engine with a host tier copies the blocks new to it there on its own core, inside its
steps, a block a step while any wait (the tier's worker paces its stores:
`tier.store_pacing`): each such step takes `tier_store_ms_per_block` longer, a prefill's
chunks too; an engine with nothing to run keeps stepping until its stores are done (vLLM holds
a finished request's blocks until they are stored), a block per `tier_store_ms_per_block`.
The worker copies a thirty-second of a backlog of more than 32 blocks a step: the same time
in all, over fewer steps than here.

Below the host tier an engine may read and write a tier it shares with the other engine of its
pair (`shared`: the launcher's file tier under `--shared-tier`, one folder for a machine's
engines): what either engine stored, the other reads back at the tier's rate instead of
computing it. Its writes run on the tier's own threads, not in the engine's steps (the bench
measured no cost of them), and it outlives the engine: a lost engine's histories stay there.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Generator
from typing import Any

import simpy

from turnkv_server.sim.kv_cache import SessionKvCache
from turnkv_server.sim.service_costs import ServiceCosts


class SimEngine:
    def __init__(self, env: simpy.Environment, name: str, costs: ServiceCosts,
                 cache: SessionKvCache, tier: SessionKvCache | None = None,
                 shared: SessionKvCache | None = None) -> None:
        self.env = env
        self.name = name
        self.costs = costs
        self.cache = cache
        self.tier = tier
        self.shared = shared  # the tier it shares with its pair's other engine
        self.healthy = True
        self.in_flight = 0  # turns placed here and not ended (prefill or decode)
        self.homed = 0  # sessions whose home this is
        # Shared prefixes (system prompts) computed here: they stay cached (the hottest
        # blocks of the cache), for every session that starts here.
        self.prefixes: set[str] = set()
        self.prefill_busy_s = 0.0
        self.decode_busy_s = 0.0
        self._lane = simpy.Resource(env, capacity=1)
        self._steps = 0.0  # decode steps taken since the start
        self._at = 0.0  # when `_steps` was last brought up to date
        self._prefilling = 0
        self.answered_s = float("-inf")  # when its latest prompt was done: its answer began
        self._chunk_ms = 0.0  # the running prefill's time per chunk
        self._stores = 0.0  # blocks waiting to be copied to the tier, a block a step
        self._decoding: list[tuple[float, int, simpy.Event]] = []
        self._seq = itertools.count()
        self._generation = 0
        self._room = env.event()

    # -- prefill ---------------------------------------------------------------------------

    @property
    def prompts(self) -> int:
        """Prompts it is computing or has queued: what the router counts as requests whose
        answer has not begun (`router.engines.Engine.prefilling`)."""
        return self._lane.count + len(self._lane.queue)

    def lane(self) -> simpy.resources.resource.Request:
        """The engine's prefill lane, first come first served: hold it to `compute`."""
        return self._lane.request()

    def compute(self, ms: float, tokens: int) -> Generator[simpy.Event, Any, float]:
        """Compute `tokens` of a prompt for `ms` (the lane held), in chunks that share the
        engine's steps with its decoding turns, from the step after the next
        (`steps_to_join_ms`); returns the ms its chunks' steps spent on the tier's stores."""
        join_ms = self.steps_to_join_ms()
        if join_ms > 0:
            yield self.env.timeout(join_ms / 1000)
        self._advance()
        self._prefilling += 1
        chunks = max(1, -(-tokens // self.costs.prefill_chunk_tokens))
        # Each chunk's step copies a block of the stores waiting, before its output returns.
        stored = min(float(chunks), self._stores)
        self._stores -= stored
        store_ms = stored * self.costs.tier_store_ms_per_block
        ms += store_ms
        self._chunk_ms = ms / chunks
        self._reschedule()
        yield self.env.timeout(ms / 1000)
        self._advance()
        self._prefilling -= 1
        self.answered_s = self.env.now
        self._chunk_ms = 0.0
        self.prefill_busy_s += ms / 1000
        self._reschedule()
        return store_ms

    # -- decode ----------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self._decoding)

    def decode(self, tokens: int) -> simpy.Event:
        """An event that fires once `tokens` more steps have been taken with this turn in the
        batch."""
        done = self.env.event()
        if tokens <= 0:
            done.succeed()
            return done
        self._advance()
        heapq.heappush(self._decoding, (self._steps + tokens, next(self._seq), done))
        self._reschedule()
        return done

    def store(self, blocks: int) -> None:
        """`blocks` more to copy to the engine's tier, paced over its steps."""
        if self.tier is None or blocks <= 0 or self.costs.tier_store_ms_per_block <= 0:
            return
        self._advance()
        self._stores += blocks
        self._reschedule()

    @property
    def stores_waiting(self) -> float:
        return self._stores

    def steps_to_join_ms(self) -> float:
        """How long a prompt reaching the engine now waits to be in a step: none where nothing
        decodes (the engine idles, and schedules it at once), else the rest of the step in
        progress. vLLM schedules the next step once a step's forward pass returns, and on
        CPU that pass runs in the scheduler's own thread (`UniProcExecutor.collective_rpc`
        calls it inline), so no step is scheduled ahead of the one running; a GPU's
        asynchronous scheduling would add one (not modelled). The bench's engines took more
        than that (the decoding turns' outputs and, with a host tier, their blocks' copies to
        it share the engine's core): the fitted steps beyond (`ServiceCosts.join_wait`) are
        added."""
        if not self._decoding:
            return 0.0
        self._advance()
        rest = math.ceil(self._steps - 1e-9) - self._steps
        # The step in progress copies a block of the tier's stores if any wait; the fitted
        # steps beyond are plain ones.
        return ((rest + self.costs.join_wait(self.tier is not None)) * self.step_ms()
                + rest * self._store_ms())

    def step_ms(self) -> float:
        step = self.costs.decode_step_ms(len(self._decoding))
        return max(step, self._chunk_ms) if self._prefilling else step

    def _store_ms(self) -> float:
        """What a decode step takes longer now for the block of the stores it copies: a
        running prefill's chunks copied theirs as it started (`compute`)."""
        if self._stores <= 0 or self._prefilling:
            return 0.0
        return self.costs.tier_store_ms_per_block

    def _advance(self) -> None:
        now = self.env.now
        if now > self._at:
            elapsed = now - self._at
            elapsed_ms = elapsed * 1000
            if self._decoding:
                self._steps += self._steps_in(elapsed_ms)
                self.decode_busy_s += elapsed
            elif self._stores > 0 and not self._prefilling:
                self._stores = max(
                    0.0, self._stores - elapsed_ms / self.costs.tier_store_ms_per_block)
        self._at = now

    def _steps_in(self, ms: float) -> float:
        """Decode steps taken in `ms`, the stores waiting copied a block a step."""
        step, store = self.step_ms(), self._store_ms()
        if store <= 0:
            return ms / step
        storing_ms = self._stores * (step + store)
        if ms <= storing_ms:
            steps = ms / (step + store)
            self._stores -= steps
            return steps
        steps = self._stores + (ms - storing_ms) / step
        self._stores = 0.0
        return steps

    def _ms_for(self, steps: float) -> float:
        """How long `steps` more decode steps take (`_steps_in`'s inverse)."""
        step, store = self.step_ms(), self._store_ms()
        storing = min(steps, self._stores) if store > 0 else 0.0
        return storing * (step + store) + (steps - storing) * step

    def _reschedule(self) -> None:
        self._generation += 1
        if not self._decoding:
            return
        left = max(0.0, self._decoding[0][0] - self._steps)
        wake = self.env.timeout(self._ms_for(left) / 1000)
        generation = self._generation
        wake.callbacks.append(lambda _: self._tick(generation))

    def _tick(self, generation: int) -> None:
        if generation != self._generation:
            return  # the batch changed since: a later wake-up stands
        self._advance()
        while self._decoding and self._decoding[0][0] <= self._steps + 1e-6:
            heapq.heappop(self._decoding)[2].succeed()
        self._reschedule()

    def turn_ended(self) -> None:
        self.in_flight -= 1
        room, self._room = self._room, self.env.event()
        room.succeed()

    def room_changed(self) -> simpy.Event:
        """Fires when a turn here ends (its decode's blocks may have come free)."""
        return self._room

    def lose(self) -> None:
        """The engine is gone: its cache and host tier with it (not the shared tier)."""
        self.healthy = False
        self._stores = 0.0
        self.cache.clear()
        self.prefixes.clear()
        if self.tier is not None:
            self.tier.clear()
