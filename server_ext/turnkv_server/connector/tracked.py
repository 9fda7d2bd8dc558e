"""What the connector's scheduler half remembers of each request it serves, from its arrival
to its end: its params, where its prompt's tokens came from (the reply), and, for a send that
streams, its blocks as its steps were scheduled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from turnkv_server.engine.protocol import TurnParams


@dataclass
class TrackedRequest:
    params: TurnParams
    prompt_tokens: int = 0
    # The request's block IDs as its steps were scheduled (streaming sends only).
    blocks: list[int] | None = None
    local_tokens: int = 0
    # Tokens loaded through this connector's receive, as vLLM allocated them; once the request
    # is first scheduled, those it kept (`first_scheduled`).
    external_tokens: int = 0
    scheduled: bool = False
    over_quarantine: bool = False  # a receive declined for quarantined blocks over their cap
    receive_done: bool = False
    receive_failed: bool = False
    # When vLLM gave the request its blocks, and how long the request then waited for a lower
    # tier (the offloading connector beside this one) to load its KV into them: 0 where the
    # tier loaded it in the step that computes the rest (`tier.offloading_connector`).
    allocated_at: float | None = None
    restore_ms: float | None = None

    def first_scheduled(self, computed_tokens: int) -> None:
        """Scheduled for the first time, from `computed_tokens` on: its KV arrived, and vLLM
        computes again what it did not keep of it (the last token of a prompt received whole,
        so that the next one is sampled)."""
        self.scheduled = True
        loaded = computed_tokens - self.local_tokens
        if self.restore_ms is None and loaded > self.external_tokens:
            # More than this connector's receive: the tier beside it loaded the rest, and no
            # step waited for it (an asynchronous load reports first, `SchedulerSide.received`).
            self.restore_ms = 0.0
        self.external_tokens = max(0, min(self.external_tokens, loaded))

    def completed_blocks(self, new_blocks: Sequence[int], replace: bool, computed_tokens: int,
                         scheduled_tokens: int, block_size: int
                         ) -> tuple[list[tuple[int, int]], bool]:
        """A step computes `scheduled_tokens` of the prompt from `computed_tokens` on, with
        `new_blocks` added to the request's blocks (`replace`: as all of them, a new or resumed
        request): the (index, block ID) pairs of the prompt's blocks it completes, and whether
        the request restarts (preempted, it recomputes)."""
        restart = replace and self.blocks is not None
        if replace or self.blocks is None:
            self.blocks = list(new_blocks)
        else:
            self.blocks += new_blocks
        prompt = self.prompt_tokens
        start, end = computed_tokens, min(computed_tokens + scheduled_tokens, prompt)
        if start >= end:
            return [], restart  # decoding: the prompt's blocks are complete
        done = [(k, self.blocks[k])
                for k in range(start // block_size, (end - 1) // block_size + 1)
                if min((k + 1) * block_size, prompt) <= end and k < len(self.blocks)]
        return done, restart
