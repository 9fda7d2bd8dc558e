"""The serving modes, by name: declared here once, read by the router's registry and settings,
the launcher, the benchmark and the command line's help.

A router serves one of `ROUTER_MODES` (docs/protocol.md says what each does); a cluster runs one
of `CLUSTER_MODES`: a router mode in front of prefill and decode engines (the launcher starts a
`standard` cluster with the prefill engines' prefix cache off as a `standard-nocache` router),
the `affinity` router in front of aggregated engines (each serves its sessions' turns whole),
or one engine alone (`single`, no router). The benchmark's modes are its baselines (what a
platform runs without turnkv: `BENCH_BASELINES`) and turnkv with its forms and options
(`TURNKV_BENCH_MODES`), each a cluster mode with at most a few settings changed.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple, get_args

RouterMode = Literal["turnkv", "standard", "standard-nocache", "bidirectional", "push",
                     "affinity"]
ROUTER_MODES: tuple[RouterMode, ...] = get_args(RouterMode)
# `turnkv up`'s and `turnkv router`'s.
DEFAULT_MODE: RouterMode = "turnkv"

ClusterMode = Literal["turnkv", "single", "standard", "bidirectional", "push", "affinity"]
CLUSTER_MODES: tuple[ClusterMode, ...] = get_args(ClusterMode)

# The benchmark's engines x cores each where a mode says none: two engines of one core (P/D: one
# prefill and one decode engine; affinity: two aggregated ones). Ratios between modes mean
# something only where the cores are equal.
PAIR = (2, 1)


class BenchMode(NamedTuple):
    """A benchmark mode: the cluster mode it starts, what it changes there (its help), its
    engines x cores each, and whether each engine has a host-memory tier below its cache (as
    big as `bound`'s cache: every session's context)."""

    cluster: ClusterMode
    help: str
    layout: tuple[int, int] = PAIR
    host_tier: bool = False


# The baselines: what a platform runs without turnkv, in the order the benchmark's help and
# default list them. `affinity` and `single-2core` take the two cores the P/D modes share.
BENCH_BASELINES: dict[str, BenchMode] = {
    "single": BenchMode("single", "one engine, prefix caching, one core", (1, 1)),
    "single-2core": BenchMode("single", "the same engine on both cores", (1, 2)),
    "affinity": BenchMode(
        "affinity", "two aggregated engines behind a router that keeps each session on one"),
    "affinity-offload": BenchMode(
        "affinity", "affinity's engines with vLLM's own offloading to a host tier under its "
        "LRU, as big as bound's cache (no turnkv connector)", host_tier=True),
    "bound": BenchMode(
        "affinity", "affinity with caches that hold every session (a pressure preset's "
        "no-pressure bound)"),
    "standard": BenchMode("standard", "vLLM's P/D: the prefill engine's KV to the decode "
                          "engine over NIXL"),
    "standard-nocache": BenchMode(
        "standard", "standard with the prefill engine's prefix cache off (vLLM's multi-turn "
        "blog baseline)"),
    "bidirectional": BenchMode(
        "bidirectional", "standard whose prefill engine reads a session's history back from "
        "the decode engine"),
    "push": BenchMode("push", "standard with the prefill engine writing the KV to the decode "
                      "engine"),
}
# turnkv, and its forms and options measured beside it (the planner is to absorb them).
TURNKV_BENCH_MODES: dict[str, BenchMode] = {
    "turnkv": BenchMode(
        "turnkv", "sessions' KV kept on their engines across turns, each turn placed by the "
        "planner, with affinity-offload's host tier below each engine's cache and a file "
        "tier below both that either engine reads",
        host_tier=True),
    "turnkv-own-tier": BenchMode(
        "turnkv", "turnkv whose engines' host tiers share no file tier: a session's history "
        "is read back only by its home (the other engine computes it)", host_tier=True),
    "turnkv-no-hold": BenchMode(
        "turnkv", "turnkv sending every prompt at once, even onto an engine where a turn that "
        "moves KV has not landed (--no-landing-holds)", host_tier=True),
    "turnkv-end-write": BenchMode(
        "turnkv", "turnkv sending a prefill's KV in one write when it ends, not layer by "
        "layer"),
    "turnkv-tier": BenchMode(
        "turnkv", "turnkv's P/D form (--fixed-pools: one prefill and one decode engine) with "
        "turnkv's host tier", host_tier=True),
    "turnkv-pool": BenchMode(
        "turnkv", "turnkv whose router keeps each session on one engine of the pair, every "
        "turn whole (--pair-pool)", host_tier=True),
    "affinity-tier": BenchMode(
        "affinity", "affinity's engines with the turnkv connector (leases, hint-ordered "
        "eviction) and turnkv-tier's tier", host_tier=True),
}
BENCH_MODE_TABLE: dict[str, BenchMode] = {**BENCH_BASELINES, **TURNKV_BENCH_MODES}
BENCH_MODES: tuple[str, ...] = tuple(BENCH_MODE_TABLE)
# `turnkv bench`'s default: every baseline beside turnkv.
DEFAULT_BENCH_MODES = ",".join((*BENCH_BASELINES, "turnkv"))
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
    if mode not in BENCH_MODE_TABLE:
        raise ValueError(f"unknown benchmark mode {mode!r}")
    return BENCH_MODE_TABLE[mode].cluster


def bench_layout(mode: str) -> tuple[int, int]:
    """(engines, cores per engine) of a benchmark mode."""
    entry = BENCH_MODE_TABLE.get(tagged_mode(mode))
    return entry.layout if entry is not None else PAIR


def has_host_tier(mode: str) -> bool:
    """Whether a benchmark mode's engines have a host-memory tier below their caches."""
    base = tagged_mode(mode)
    return base in BENCH_MODE_TABLE and BENCH_MODE_TABLE[base].host_tier


def describe_bench_modes(with_help: bool = False) -> str:
    """Each benchmark mode with its engines x cores each (and with `with_help`, what it is),
    the baselines first, then turnkv and its forms and options: for the command line."""
    sep = "; " if with_help else ", "

    def named(table: dict[str, BenchMode]) -> str:
        return sep.join("{} ({}x{})".format(mode, *entry.layout)
                         + (f": {entry.help}" if with_help else "")
                         for mode, entry in table.items())

    itl = "turnkv-itl<ms> ({}x{})".format(*PAIR) + (
        ": turnkv with an ITL target of <ms>" if with_help else "")
    untagged = "any of them as <mode>-untagged" + (
        " (its turns from a stock openai client: no session named, no hints)"
        if with_help else "")
    return (f"baselines: {named(BENCH_BASELINES)}. turnkv and its forms and options: "
            f"{named(TURNKV_BENCH_MODES)}{sep}{itl}. And {untagged}")
