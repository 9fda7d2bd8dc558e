"""vLLM's `--kv-transfer-config` for each engine of a cluster, by serving mode and role.

In `turnkv` mode every engine loads this project's connector (`TURNKV_CONNECTOR_MODULE`); the
upstream modes load vLLM's own NIXL connectors through `NIXL_CONNECTOR_MODULE`, which
re-exports them tuned for CPU hosts. A `single` engine loads none; an `affinity` cluster's
aggregated engine loads none, or turnkv's with `engine_leases` (leases and the tier, no peer),
or with a tier and no `engine_leases`, vLLM's `OffloadingConnector` alone under vLLM's own LRU
(the benchmark's `affinity-offload`: what a platform gets from vLLM without turnkv).
`Cluster` puts the result in each engine's spec, and names each engine's `engine_id` from it on
the router's command line.

A turnkv engine with a lower tier (`tier_host_blocks`) loads two connectors under vLLM's
`MultiConnector`: turnkv's first, so that KV the peer engine pushes wins (MultiConnector loads
from the first connector that reports tokens), then vLLM's `OffloadingConnector` with this
project's host-memory spec (`turnkv_server.tier`), which serves what neither the prefix cache
nor the peer has: a session whose blocks were evicted under pressure. Beside turnkv the
offloading connector is `HostTierConnector` (`tier.offloading_connector`), vLLM's with its
store fence covering the blocks the peer writes. `host_tier` with a
`disk_tier` puts this project's bounded, checked disk tier below host memory, and with a
`shared_tier` vLLM's file-system tier, one folder every engine of the cluster reads and writes:
a block any engine stored there, any other can load (its file is named by the block's hash,
which vLLM seeds the same in every process under its default sha256), so the router may move a
session to the other engine, which reads its history there rather than compute it again.

Every turnkv engine is configured with ``"kv_load_failure_policy": "recompute"`` (at the top,
where vLLM reads it; the connector refuses to start under any other). The side channel's secret
is never in this config, which vLLM logs: the launcher passes the cluster's secret in each
engine's environment (`launcher.engine`), and refuses connector settings that name one.
"""

from __future__ import annotations

from typing import Any

from turnkv_server.launcher.engine import Role
from turnkv_server.router.config import RouterConfig

NIXL_CONNECTOR_MODULE = "turnkv_server.engine.nixl_tuning"
TURNKV_CONNECTOR_MODULE = "turnkv_server.connector.vllm_connector"
TIER_SPEC_MODULE = "turnkv_server.tier.vllm_spec"
TIER_CONNECTOR_MODULE = "turnkv_server.tier.offloading_connector"
TIER_CONNECTOR_CLASS = "HostTierConnector"
DISK_TIER_MODULE = "turnkv_server.tier.disk"
DISK_TIER_CLASS = "CheckedDiskTier"
SHARED_TIER_MODULE = "turnkv_server.tier.shared_files"
SHARED_TIER_CLASS = "SharedFileTier"
SESSION_ORDER_MODULE = "turnkv_server.tier.session_order"
SESSION_ORDER_POLICY = "SessionOrderPolicy"


def kv_transfer_config(
    mode: str, role: Role, engine_id: str, decoder_kv_ttl: float = RouterConfig.decoder_kv_ttl,
    recompute_threshold: int | None = None, connector_settings: dict[str, Any] | None = None,
    tier_host_blocks: int | None = None, engine_leases: bool = False,
    tier_disk: dict[str, Any] | None = None, tier_shared: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config for an engine of ``role`` in a cluster of ``mode``; an
    aggregated engine's only with `engine_leases` (the turnkv connector, with no peer) or a
    tier (vLLM's offloading alone).
    `tier_disk` (a `disk_tier` entry) and `tier_shared` (a `shared_tier` one, turnkv's engines
    only) go below the host tier."""
    if role == "single" or (role == "engine" and not engine_leases):
        if role == "single" or tier_host_blocks is None:
            return None
        # vLLM reads the load-failure policy from the top level: a failed host read is
        # recomputed, as under the turnkv connector.
        return {**host_tier(tier_host_blocks, tier_disk, session_order=False),
                "kv_load_failure_policy": "recompute"}
    if mode == "turnkv" or role == "engine":
        refuse_secret_settings(connector_settings or {})
        # One class on both roles; a failed receive is recomputed, never served.
        turnkv = {
            "kv_connector": "TurnkvConnector",
            "kv_connector_module_path": TURNKV_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(connector_settings or {}),
        }
        if tier_host_blocks is None:
            return {**turnkv, "engine_id": engine_id}
        # vLLM reads the load-failure policy from the engine's own config, not a child's.
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "connectors": [turnkv, host_tier(tier_host_blocks, tier_disk,
                                                 beside_turnkv=True, shared=tier_shared)]},
        }
    config: dict[str, Any] = {
        "kv_connector": "NixlPushConnector" if mode == "push" else "NixlConnector",
        "kv_connector_module_path": NIXL_CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }
    if mode == "bidirectional":
        # Both directions on both engines: the decode engine holds finished turns and the
        # prefill engine reads them back.
        config["kv_role"] = "kv_both"
        config["kv_connector_extra_config"] = {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": int(decoder_kv_ttl),
        }
        if recompute_threshold is not None:
            config["kv_connector_extra_config"]["kv_recompute_threshold"] = recompute_threshold
    return config


def refuse_secret_settings(settings: dict[str, Any]) -> None:
    """The launcher gives the engines their secret (`ClusterConfig.side_channel_secret`, or
    a new one) in their environment; connector settings naming one would be logged or
    conflict with it."""
    named = sorted({"side_channel_secret", "side_channel_secret_file"} & set(settings))
    if named:
        raise ValueError(
            f"connector settings {', '.join(named)}: the launcher passes the cluster's "
            f"side-channel secret in each engine's environment (never in its "
            f"--kv-transfer-config, which vLLM logs): ClusterConfig.side_channel_secret, "
            f"or a new one per cluster")


def disk_tier(root_dir: str, max_bytes: int) -> dict[str, Any]:
    """A `secondary_tiers` entry for this project's disk tier (`turnkv_server.tier.disk`):
    at most `max_bytes` of chunk files under `root_dir`, each checked when read back. vLLM's
    tiering loads it by module path."""
    if not root_dir:
        raise ValueError("the disk tier needs a root_dir")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"the disk tier's max_bytes must be a positive integer, got {max_bytes!r}")
    return {
        "type": DISK_TIER_CLASS,
        "module_path": DISK_TIER_MODULE,
        "root_dir": root_dir,
        "max_bytes": max_bytes,
    }


def shared_tier(root_dir: str) -> dict[str, Any]:
    """A `secondary_tiers` entry for vLLM's file-system tier in `root_dir`, which every engine
    of a cluster names alike: a file per chunk, written to a temporary name and renamed, found
    by its name (the chunk's block hash), read by any engine; its lookups answered at once
    (`tier.shared_files`: the folder is on this machine). It deletes no file: the launcher
    owns the folder (`launcher.cluster`), empties it at start and removes it at stop. Two
    threads each way, not vLLM's sixteen: an engine here has one or two cores."""
    if not root_dir:
        raise ValueError("the shared tier needs a root_dir")
    return {"type": SHARED_TIER_CLASS, "module_path": SHARED_TIER_MODULE, "root_dir": root_dir,
            "n_read_threads": 2, "n_write_threads": 2}


def host_tier(host_blocks: int, disk: dict[str, Any] | None = None,
              session_order: bool = True, beside_turnkv: bool = False,
              shared: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `OffloadingConnector` over this project's host-memory spec, `host_blocks` engine
    blocks big; replies are stored too (vLLM's default stores prompts only, and an agent's
    next turn starts with its last reply). Its evictions follow the sessions' hints
    (`session_order`), else vLLM's LRU. With `disk` (a `disk_tier` entry) the host tier is
    the primary of vLLM's tiering manager, with that disk tier below it; with `shared` (a
    `shared_tier` entry), that tier below it, after any disk tier (a lookup stops at the
    first tier that holds a chunk: an engine's own files first). `beside_turnkv`:
    under `MultiConnector` after turnkv's connector, whose receives write blocks vLLM's own
    offloading connector does not fence (`tier.offloading_connector`); alone, vLLM's own."""
    if host_blocks < 1:
        raise ValueError("the host tier needs at least one block")
    extra: dict[str, Any] = {
        "spec_name": "HostOffloadingSpec",
        "spec_module_path": TIER_SPEC_MODULE,
        "host_blocks": host_blocks,
        "offload_prompt_only": False,
    }
    if session_order:
        # The sessions' hints order the tier's evictions (LRU for requests without hints).
        extra["eviction_policy"] = SESSION_ORDER_POLICY
        extra["cache_policy_module_path"] = SESSION_ORDER_MODULE
    else:
        extra["eviction_policy"] = "lru"
    secondaries = [dict(tier) for tier in (disk, shared) if tier is not None]
    if secondaries:
        extra["spec_name"] = "HostTieringOffloadingSpec"
        extra["secondary_tiers"] = secondaries
    connector: dict[str, Any] = {"kv_connector": "OffloadingConnector"}
    if beside_turnkv:
        connector = {"kv_connector": TIER_CONNECTOR_CLASS,
                     "kv_connector_module_path": TIER_CONNECTOR_MODULE}
    return {**connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
