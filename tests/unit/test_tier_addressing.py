"""Engine block -> host chunk slot, per transfer, as vLLM's CPU worker addresses them."""

from __future__ import annotations

import pytest

from turnkv_server.tier.addressing import AddressingError, plan_copies


def triples(copy) -> list[tuple[int, int, int]]:
    return list(zip(copy.engine_rows.tolist(), copy.host_chunks.tolist(),
                    copy.host_slots.tolist(), strict=True))


def test_one_block_per_chunk_is_one_to_one() -> None:
    (copy,) = plan_copies([7, 3, 9], [3], [0], [2, 0, 1], blocks_per_chunk=1)
    assert triples(copy) == [(7, 2, 0), (3, 0, 0), (9, 1, 0)]


def test_chunks_of_four_fill_slots_in_order() -> None:
    (copy,) = plan_copies(list(range(10, 18)), [8], [0], [5, 1], blocks_per_chunk=4)
    assert triples(copy) == [(10 + i, 5 if i < 4 else 1, i % 4) for i in range(8)]


def test_a_group_starting_mid_chunk_skips_slots_and_may_end_in_a_partial_chunk() -> None:
    # Logical blocks 6..10 of a request with chunks of 4: slots 2,3 of the first chunk, all of
    # the second, slot 0 of the third (upstream: skip = block_index % blocks_per_chunk).
    (copy,) = plan_copies([40, 41, 42, 43, 44, 45, 46], [7], [6], [8, 9, 3], blocks_per_chunk=4)
    assert triples(copy) == [(40, 8, 2), (41, 8, 3), (42, 9, 0), (43, 9, 1), (44, 9, 2),
                             (45, 9, 3), (46, 3, 0)]


def test_groups_take_their_blocks_and_chunks_in_turn_and_empty_groups_take_none() -> None:
    copies = plan_copies([1, 2, 3, 4, 5], [2, 0, 3], [0, 0, 1], [10, 11, 12], blocks_per_chunk=2)
    assert [c.group for c in copies] == [0, 2]
    assert triples(copies[0]) == [(1, 10, 0), (2, 10, 1)]
    assert triples(copies[1]) == [(3, 11, 1), (4, 12, 0), (5, 12, 1)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 2, 3], [2], [0], [0, 1, 2], 1), "add up to 2 blocks, but the transfer names 3"),
        (([1, 2], [2], [0], [0], 1), "needs 2 host chunk"),
        (([1, 2], [2], [0], [0, 1, 2], 1), "names 3 host chunks but its blocks fill 2"),
        (([1, 2], [2], [0, 0], [0, 1], 1), "1 group sizes but 2 block indices"),
        (([1], [1], [0], [0], 0), "blocks_per_chunk must be positive"),
    ],
)
def test_disagreeing_counts_are_refused(args, message: str) -> None:
    with pytest.raises(AddressingError, match=message):
        plan_copies(*args)
