"""Stores to the host tier paced over engine steps (`tier.store_pacing`): which blocks each step
copies, and that every block of every job is copied exactly once."""

from __future__ import annotations

import numpy as np

from turnkv_server.tier.addressing import GroupCopy
from turnkv_server.tier.store_pacing import StoreQueue


def copy(group: int, rows: list[int]) -> GroupCopy:
    """A group's copy of `rows` (engine rows), to host chunk = row, slot 0."""
    array = np.asarray(rows, dtype=np.int64)
    return GroupCopy(group, array, array.copy(), np.zeros(len(rows), dtype=np.int64))


def rows_of(copies: list[GroupCopy]) -> list[tuple[int, int]]:
    return [(c.group, int(r)) for c in copies for r in c.engine_rows]


def test_nothing_waiting_copies_nothing() -> None:
    queue = StoreQueue()
    assert queue.blocks_this_step() == 0 and queue.take(0) == []


def test_a_short_backlog_goes_a_block_a_step_and_the_job_is_last_with_its_last_block() -> None:
    queue = StoreQueue()
    queue.add(1, [copy(0, [5, 6, 7])])
    seen = []
    for step in range(3):
        assert queue.blocks_this_step() == 1
        (part,) = queue.take(queue.blocks_this_step())
        assert part.job_id == 1 and part.last == (step == 2)
        seen += rows_of(part.copies)
    assert seen == [(0, 5), (0, 6), (0, 7)] and queue.pending_blocks == 0 and not len(queue)


def test_a_long_backlog_drains_by_a_share_of_it_per_step() -> None:
    queue = StoreQueue()
    queue.add(1, [copy(0, list(range(70)))])
    queue.add(2, [copy(0, list(range(100, 120)))])
    assert queue.blocks_this_step() == 3  # a share of 90 blocks, rounded up
    taken = [queue.blocks_this_step()]
    queue.take(taken[0])
    while queue.pending_blocks:
        taken.append(queue.blocks_this_step())
        queue.take(taken[-1])
    assert sum(taken) == 90 and taken[-1] == 1 and taken == sorted(taken, reverse=True)


def test_a_step_crosses_jobs_and_groups_in_submission_order() -> None:
    queue = StoreQueue()
    queue.add(1, [copy(0, [1, 2]), copy(1, [3])])
    queue.add(2, [copy(0, [4, 5])])
    first, second = queue.take(4)
    assert (first.job_id, first.last, rows_of(first.copies)) == (1, True, [(0, 1), (0, 2), (1, 3)])
    assert (second.job_id, second.last, rows_of(second.copies)) == (2, False, [(0, 4)])
    (rest,) = queue.take(4)
    assert (rest.job_id, rest.last, rows_of(rest.copies)) == (2, True, [(0, 5)])


def test_a_job_waited_on_is_taken_whole_whatever_was_copied_of_it() -> None:
    queue = StoreQueue()
    queue.add(1, [copy(0, [1, 2, 3])])
    queue.add(2, [copy(0, [4])])
    queue.take(1)
    (part,) = queue.take_jobs([1, 9])  # job 9 is not queued: nothing
    assert (part.job_id, part.last, rows_of(part.copies)) == (1, True, [(0, 2), (0, 3)])
    assert queue.pending_blocks == 1 and len(queue) == 1


def test_a_job_of_no_blocks_is_reported_at_the_next_step() -> None:
    queue = StoreQueue()
    queue.add(3, [])
    (part,) = queue.take(queue.blocks_this_step())
    assert (part.job_id, part.last, part.copies) == (3, True, [])
