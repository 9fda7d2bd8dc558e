"""The host tier a `turnkv bench` run had below each engine's cache, and whether its engines
shared a tier below those, read from its results: what the simulator replays it with, and what
the cost fit groups its turns by."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from turnkv_server.bench.cli import VLLM_CPU_BLOCK_TOKENS
from turnkv_server.mode_names import has_host_tier

# Modes that gained their host tier after results were first made with them, and when (UTC, as
# a result's `created` reads), for runs that do not record their own (`host_tier_blocks` in
# their `config`): before that, a run's `config` named the bench's tier size for every mode,
# not whether its mode had one.
TIER_SINCE = {"turnkv": "2026-12-03T18:52:30"}


def tier_tokens(run: Mapping[str, Any], created: str = "~") -> int:
    """Tokens of one engine's host tier in the bench run (0: it had none): the blocks its
    cluster had (`host_tier_blocks`), where the run does not record that the bench's tier
    (`tier_host_blocks`, as many as `bound`'s cache holds) if its mode has one, or where an
    older result does not say, `bound`'s cache at the run's bytes per token. `created`: the
    result's (default: made after every change of `TIER_SINCE`)."""
    config = run.get("config", {})
    block = int(config.get("block_size") or VLLM_CPU_BLOCK_TOKENS)
    if "host_tier_blocks" in config:
        return int(config["host_tier_blocks"] or 0) * block
    if not has_host_tier(run["mode"]) or created < TIER_SINCE.get(run["mode"], ""):
        return 0
    if config.get("tier_host_blocks"):
        return int(config["tier_host_blocks"]) * block
    per_token = (config.get("kv_cache_bytes") or 0) / max(1, run.get("kv_cache_tokens") or 1)
    size = config.get("bound_kv_cache_bytes")
    return int(size / per_token) if size and per_token else 0


def shares_tier(run: Mapping[str, Any]) -> bool:
    """Whether the run's engines shared a tier below their host tiers (the launcher's file
    tier): its `config` says so since that tier came; runs from before had none."""
    return bool(run.get("config", {}).get("shared_tier"))
