"""The host tier's settings: sizes in blocks or bytes, offload_prompt_only, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv_server.tier.settings import TierSettingsError, resolve, vllm_extra_config

PAGE = 4096


def settle(extra: dict[str, Any], *, block: int = 10_000, bpc: int = 1, world: int = 1):
    return resolve(extra, kv_bytes_per_block=block, blocks_per_chunk=bpc, alignment=PAGE,
                   world_size=world)


def test_blocks_give_exactly_that_many_blocks() -> None:
    settings = settle({"host_blocks": 12}, bpc=4)
    assert (settings.num_chunks, settings.host_blocks) == (3, 12)
    assert settings.chunk_bytes == 40_960  # 4 * 10_000 rounded up to the page
    assert settings.offload_prompt_only is False  # agents: replies are offloaded too


def test_bytes_round_down_to_whole_chunks() -> None:
    chunk = 12_288  # 10_000 rounded up to 3 pages
    assert settle({"cpu_bytes_to_use": 5 * chunk + chunk - 1}).num_chunks == 5


def test_vllm_reads_back_the_same_number_of_chunks() -> None:
    settings = settle({"host_blocks": 7, "eviction_policy": "arc"})
    extra = vllm_extra_config({"host_blocks": 7, "eviction_policy": "arc"}, settings)
    assert extra["cpu_bytes_to_use"] // settings.chunk_bytes == 7
    assert extra["offload_prompt_only"] is False and extra["eviction_policy"] == "arc"


def test_prompt_only_may_be_turned_on_explicitly() -> None:
    assert settle({"host_blocks": 1, "offload_prompt_only": True}).offload_prompt_only


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "exactly one of cpu_bytes_to_use .* or host_blocks .*neither"),
        ({"host_blocks": 4, "cpu_bytes_to_use": 1 << 20}, "exactly one .*both"),
        ({"host_blocks": 0}, "host_blocks must be a positive integer, got 0"),
        ({"host_blocks": -3}, "host_blocks must be a positive integer"),
        ({"host_blocks": "64"}, r"host_blocks must be a positive integer, got '64' \(str\)"),
        ({"host_blocks": True}, "host_blocks must be a positive integer, got True"),
        ({"cpu_bytes_to_use": 1.5e9}, "cpu_bytes_to_use must be a positive integer"),
        ({"cpu_bytes_to_use": 100}, "less than one offload chunk .*raise cpu_bytes_to_use"),
        ({"host_blocks": 6, "offload_prompt_only": "false"},
         "offload_prompt_only must be true or false .*got 'false'"),
        ({"host_blocks": 4, "canonical_layout": True}, "canonical_layout is not supported"),
    ],
)
def test_bad_settings_are_refused_with_the_key_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(TierSettingsError, match=message):
        settle(extra)


def test_blocks_must_fill_whole_chunks() -> None:
    with pytest.raises(TierSettingsError, match="host_blocks=6 is not a multiple of the 4 .*use 8"):
        settle({"host_blocks": 6}, bpc=4)


def test_more_than_one_worker_is_refused() -> None:
    with pytest.raises(TierSettingsError, match="world size 2"):
        settle({"host_blocks": 4}, world=2)


def test_no_geometry_yet_sizes_nothing_but_still_checks_keys() -> None:
    assert settle({"host_blocks": 4}, block=0).num_chunks == 0
    with pytest.raises(TierSettingsError):
        settle({}, block=0)
