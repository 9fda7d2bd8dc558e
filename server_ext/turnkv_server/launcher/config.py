"""How to start a local cluster (`ClusterConfig`), checked before anything starts; `Cluster`
(`cluster`) starts it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnkv_server.connector.cluster_secret import check_secret
from turnkv_server.launcher.engine import Role
from turnkv_server.launcher.host_plan import Host
from turnkv_server.launcher.placement import ROUTER, unknown_names
from turnkv_server.launcher.tool_calling import AUTO, launcher_options_in
from turnkv_server.mode_names import CLUSTER_MODES as MODES
from turnkv_server.mode_names import ClusterMode as Mode
from turnkv_server.router.config import RouterConfig

VLLM_CACHE_ENV = "TURNKV_VLLM_CACHE_DIR"  # see ClusterConfig.vllm_cache_dir


@dataclass
class ClusterConfig:
    """How to start a cluster. Defaults: one prefill and one decode engine, one core each;
    in `affinity` mode, two aggregated engines."""

    mode: Mode = "standard"
    model: str = "smollm2"
    num_prefill: int = 1
    num_decode: int = 1
    # affinity: aggregated engines (plain vLLM, prefix caching on), each serving its sessions.
    num_aggregated: int = 2
    dtype: str = "auto"
    # Turn the prefill engine's prefix cache off: the baseline of vLLM's multi-turn blog.
    prefill_cache: bool = True
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    # The engines' KV block size in tokens (None: vLLM's, 128 on CPU). A session's history is
    # reused in whole blocks: smaller blocks lose less of a prompt that breaks mid-block.
    block_size: int | None = None
    cores_per_engine: int = 1
    # bidirectional: how long decode engines hold a finished turn for the next prefill (the
    # router's setting, which the engines are given too), and read back only when at least
    # this many tokens are missing (vLLM: 64).
    decoder_kv_ttl: float = RouterConfig.decoder_kv_ttl
    kv_recompute_threshold: int | None = None
    # turnkv: turns adding at most this many tokens run on the decode engine alone.
    short_delta_tokens: int | None = None
    # Fixed ports; None: each binds a free one and reports it.
    router_port: int | None = None
    engine_ports: list[int] | None = None
    run_dir: Path | None = None
    startup_timeout: float = 300.0
    # The cluster `turnkv status` / `turnkv down` act on by default.
    register_as_current: bool = False
    # vLLM's tool-call parser on every engine, so that requests with `tools` work as on vLLM:
    # "auto" (chosen from the model's chat template, `tool_calling`), a parser's name, or
    # "none" / None (tool calling off: vLLM then refuses `tool_choice: "auto"`).
    tool_call_parser: str | None = AUTO
    # More of vLLM's server arguments for every engine, each one word of its command line
    # (`--max-num-seqs=8`); not those the launcher sets itself (`tool_calling`).
    engine_extra_args: tuple[str, ...] = field(default_factory=tuple)
    # Extra command-line arguments for the router (see `python -m turnkv_server.router -h`).
    router_args: tuple[str, ...] = field(default_factory=tuple)
    # turnkv: the connector's kv_connector_extra_config (lease TTLs, pin cap, timeouts). turnkv
    # and affinity: each engine's host-memory KV tier in blocks (None: none). affinity with
    # `engine_leases`: the engines run the turnkv connector (and the tier) and hold sessions'
    # leases; without, a tier is vLLM's offloading alone, under its LRU.
    connector_settings: dict[str, Any] = field(default_factory=dict)
    tier_host_blocks: int | None = None
    # Below each host tier, a disk tier of at most this many bytes in the run folder (None:
    # none): this project's bounded, checked files (`turnkv_server.tier.disk`).
    tier_disk_bytes: int | None = None
    # turnkv with a host tier: below the engines' host tiers, a file tier they all read and
    # write, in the run folder (`kv_transfer.shared_tier`), so that a session can move to
    # another engine without its history computed again. None: where every engine runs on
    # this machine (simulated hosts share its file system, which real ones would not).
    tier_shared: bool | None = None
    engine_leases: bool = False
    # turnkv: the engines' side-channel secret (their environment only); None: a new one.
    side_channel_secret: str | None = field(default=None, repr=False)
    # vLLM's cache, shared by the engines; None: $TURNKV_VLLM_CACHE_DIR, else the run folder's.
    vllm_cache_dir: Path | None = None
    # Simulated hosts (`launcher.hosts`, up before the cluster starts) by process name: an
    # engine's (`engine_names()`) or "router"; a process not named runs on 127.0.0.1 here.
    # See `launcher.placement`.
    hosts: Mapping[str, Host] | None = None

    def roles(self) -> list[Role]:
        """Each engine's role, in start order."""
        if self.mode == "single":
            return ["single"]
        if self.mode == "affinity":
            return ["engine"] * self.num_aggregated
        prefill: list[Role] = ["prefill"] * self.num_prefill
        decode: list[Role] = ["decode"] * self.num_decode
        return prefill + decode

    def shares_tier(self) -> bool:
        """Whether the engines share a file tier below their host tiers (`tier_shared`)."""
        if self.tier_shared is not None:
            return self.tier_shared
        return self.mode == "turnkv" and self.tier_host_blocks is not None and not self.hosts

    def engine_names(self) -> list[str]:
        """Each engine's name, in start order: "single", or its role and index ("decode-0")."""
        counters: dict[str, int] = {}
        names = []
        for role in self.roles():
            index = counters.get(role, 0)
            counters[role] = index + 1
            names.append(role if role == "single" else f"{role}-{index}")
        return names

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode == "affinity" and self.num_aggregated < 1:
            raise ValueError("an affinity cluster needs at least one engine")
        if self.mode not in ("single", "affinity") and (
                self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a prefill/decode cluster needs at least one engine of each role")
        if self.cores_per_engine < 1:
            raise ValueError("cores_per_engine must be at least 1")
        if self.short_delta_tokens is not None and self.short_delta_tokens < 0:
            raise ValueError("short_delta_tokens must be non-negative")
        if (self.engine_leases and self.mode != "affinity") or (
                self.tier_host_blocks is not None and self.mode not in ("turnkv", "affinity")):
            raise ValueError("engine_leases is for affinity clusters; tier_host_blocks for "
                             "turnkv and affinity ones")
        if self.tier_disk_bytes is not None and (
                self.tier_host_blocks is None or self.tier_disk_bytes < 1):
            raise ValueError("tier_disk_bytes goes below a host tier (tier_host_blocks) and "
                             "must be positive")
        if self.tier_shared and (self.mode != "turnkv" or self.tier_host_blocks is None):
            raise ValueError("tier_shared goes below a turnkv cluster's host tiers "
                             "(tier_host_blocks)")
        if self.side_channel_secret is not None:
            # Refused here, with the engines' own words, rather than by every engine at start.
            check_secret(self.side_channel_secret.encode())
        owned = launcher_options_in(self.engine_extra_args)
        if owned:
            raise ValueError(f"engine arguments {', '.join(owned)} are set by turnkv itself "
                             "(tool calling: tool_call_parser, `turnkv up --tool-call-parser`)")
        if self.hosts:
            # A `single` cluster has no router: its engine is the endpoint.
            names = self.engine_names() + ([] if self.mode == "single" else [ROUTER])
            unknown = unknown_names(self.hosts, names)
            if unknown:
                raise ValueError(f"hosts: no process named {', '.join(unknown)} in this "
                                 f"cluster (its processes: {', '.join(names)})")
