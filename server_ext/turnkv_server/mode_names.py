"""The serving modes, by name: declared here once, read by the router's registry and settings,
the launcher, the benchmark and the command line's help.

A router serves one of `ROUTER_MODES` (docs/protocol.md says what each does); a cluster runs one
of `CLUSTER_MODES`: a router mode in front of prefill and decode engines (the launcher starts a
`standard` cluster with the prefill engines' prefix cache off as a `standard-nocache` router),
the `affinity` router in front of aggregated engines (each serves its sessions' turns whole),
or one engine alone (`single`, no router). The benchmark also measures variants, each a cluster
mode with one setting changed.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

RouterMode = Literal["turnkv", "standard", "standard-nocache", "bidirectional", "push",
                     "affinity"]
ROUTER_MODES: tuple[RouterMode, ...] = get_args(RouterMode)
# `turnkv up`'s and `turnkv router`'s.
DEFAULT_MODE: RouterMode = "turnkv"

ClusterMode = Literal["turnkv", "single", "standard", "bidirectional", "push", "affinity"]
CLUSTER_MODES: tuple[ClusterMode, ...] = get_args(ClusterMode)

# Benchmark variant -> the cluster mode it changes: `standard-nocache` turns the prefill
# engines' prefix cache off (vLLM's multi-turn blog baseline); `turnkv-end-write` sends a
# prefill's KV in one write when it ends instead of layer by layer (that design choice, measured);
# `single-2core` gives the one engine both cores the P/D modes share (equal resources); `bound`
# is `affinity` with caches that hold every session (the no-pressure bound of a pressure preset);
# `turnkv-tier` is turnkv with a host-memory tier under each engine's cache, as big as `bound`'s;
# `affinity-tier` the aggregated flavour: affinity engines with the turnkv connector (leases,
# hint-aware eviction) and the same tier; `turnkv-pool` is turnkv-tier whose router keeps each
# session on one engine of the pair (`--pair-pool`).
BENCH_VARIANTS: dict[str, ClusterMode] = {"standard-nocache": "standard",
                                          "turnkv-end-write": "turnkv",
                                          "turnkv-tier": "turnkv",
                                          "turnkv-pool": "turnkv",
                                          "affinity-tier": "affinity",
                                          "single-2core": "single",
                                          "bound": "affinity"}
# In the order the benchmark's help lists them.
BENCH_MODES: tuple[str, ...] = (
    "single", "single-2core", "affinity", "bound", "standard", "standard-nocache",
    "bidirectional", "push", "turnkv", "turnkv-end-write", "turnkv-tier", "turnkv-pool",
    "affinity-tier")
# `turnkv bench`'s default: the P/D modes beside what a platform would run instead on the same
# two cores (aggregated engines with session affinity; one engine on both cores).
DEFAULT_BENCH_MODES = "affinity,single-2core,standard,bidirectional,turnkv"
# `turnkv-itl<ms>`: turnkv with the router's inter-token-latency target at <ms> milliseconds,
# so that one run can place turnkv at several points of the TTFT/ITL frontier.
ITL_VARIANT = re.compile(r"turnkv-itl(\d{1,6})")
# `<mode>-untagged`: the mode's cluster, its turns sent by a stock openai client that names no
# session and sends no hints (the router infers the sessions from the conversations).
UNTAGGED_SUFFIX = "-untagged"


def untagged(mode: str) -> bool:
    """Whether a benchmark mode sends its turns untagged (`<mode>-untagged`)."""
    return mode.endswith(UNTAGGED_SUFFIX) and is_bench_mode(mode)


def tagged_mode(mode: str) -> str:
    """The mode whose cluster a benchmark mode starts and whose settings it takes: itself, or
    for `<mode>-untagged`, `<mode>`."""
    return mode.removesuffix(UNTAGGED_SUFFIX)


def itl_variant_target(mode: str) -> float | None:
    """The ITL target of a `turnkv-itl<ms>` mode in milliseconds; None for any other name."""
    match = ITL_VARIANT.fullmatch(tagged_mode(mode))
    return float(match.group(1)) if match else None


def is_bench_mode(mode: str) -> bool:
    """Whether the benchmark knows `mode`: one of `BENCH_MODES` or a `turnkv-itl<ms>`, either
    of them with `-untagged` or not."""
    base = tagged_mode(mode)
    return base in BENCH_MODES or itl_variant_target(base) is not None


def cluster_mode(mode: str) -> ClusterMode:
    """The cluster mode a benchmark mode starts."""
    mode = tagged_mode(mode)
    if itl_variant_target(mode) is not None:
        return "turnkv"
    if mode in BENCH_VARIANTS:
        return BENCH_VARIANTS[mode]
    if mode not in CLUSTER_MODES:
        raise ValueError(f"unknown benchmark mode {mode!r}")
    return mode

# How many engines each benchmark mode starts, and how many cores each gets: ratios between
# modes mean something only where the cores are equal. Every mode not named here runs two
# engines of one core each (P/D: one prefill and one decode engine; affinity: two aggregated).
BENCH_ENGINES: dict[str, tuple[int, int]] = {"single": (1, 1), "single-2core": (1, 2)}
PAIR = (2, 1)


def bench_layout(mode: str) -> tuple[int, int]:
    """(engines, cores per engine) of a benchmark mode."""
    return BENCH_ENGINES.get(tagged_mode(mode), PAIR)


def describe_bench_modes() -> str:
    """Each benchmark mode with its engines x cores each, for the command line's help."""
    named = ", ".join("{} ({}x{})".format(mode, *bench_layout(mode)) for mode in BENCH_MODES)
    return named + ", turnkv-itl<ms> ({}x{}); any of them as <mode>-untagged".format(*PAIR)
