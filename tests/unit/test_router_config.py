"""The router's settings: each declared once, where the part that uses it says what it means."""

from __future__ import annotations

import inspect

import pytest

from turnkv_server.router.config import RouterConfig
from turnkv_server.router.sessions import LeasePolicy


def test_the_router_settings_lease_as_the_policy_does() -> None:
    """`--default-ttl` and `--max-ttl` are the lease policy's defaults, checked by it."""
    config = RouterConfig(mode="standard", prefill=["p"], decode=["d"])
    assert LeasePolicy(config.default_ttl, config.max_ttl) == LeasePolicy()
    with pytest.raises(ValueError, match="lease policy"):
        RouterConfig(mode="standard", prefill=["p"], decode=["d"], default_ttl=1000, max_ttl=900)


def test_the_launcher_and_turnkv_up_hold_finished_turns_as_the_router_does() -> None:
    """`decoder_kv_ttl` goes to the router and to the decode engines: one default for both."""
    from turnkv_server.cli import up
    from turnkv_server.launcher import ClusterConfig
    from turnkv_server.launcher.kv_transfer import kv_transfer_config

    router = RouterConfig.decoder_kv_ttl
    assert ClusterConfig().decoder_kv_ttl == router
    assert inspect.signature(up).parameters["decoder_kv_ttl"].default == router
    engine = kv_transfer_config("bidirectional", "decode", "d0")
    assert engine is not None
    assert engine["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == int(router)
