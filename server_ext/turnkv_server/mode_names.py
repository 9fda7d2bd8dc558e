"""The serving modes, by name: declared here once, read by the router's registry and settings,
the launcher, the benchmark and the command line's help.

A router serves one of `ROUTER_MODES` (docs/protocol.md says what each does); a cluster runs one
of `CLUSTER_MODES`: a router mode in front of prefill and decode engines (the launcher starts a
`standard` cluster with the prefill engines' prefix cache off as a `standard-nocache` router), or
one engine alone (`single`, no router). The benchmark also measures two variants, each a cluster
mode with one setting changed.
"""

from __future__ import annotations

from typing import Literal, get_args

RouterMode = Literal["turnkv", "standard", "standard-nocache", "bidirectional", "push"]
ROUTER_MODES: tuple[RouterMode, ...] = get_args(RouterMode)
# `turnkv up`'s and `turnkv router`'s.
DEFAULT_MODE: RouterMode = "turnkv"

ClusterMode = Literal["turnkv", "single", "standard", "bidirectional", "push"]
CLUSTER_MODES: tuple[ClusterMode, ...] = get_args(ClusterMode)

# Benchmark variant -> the cluster mode it changes: `standard-nocache` turns the prefill
# engines' prefix cache off (vLLM's multi-turn blog baseline); `turnkv-end-write` sends a
# prefill's KV in one write when it ends instead of layer by layer (that design choice, measured).
BENCH_VARIANTS: dict[str, ClusterMode] = {"standard-nocache": "standard",
                                          "turnkv-end-write": "turnkv"}
# In the order the benchmark's help lists them.
BENCH_MODES: tuple[str, ...] = (
    "single", "standard", "standard-nocache", "bidirectional", "push", "turnkv",
    "turnkv-end-write")
