"""The router's settings: each declared once, where the part that uses it says what it means."""

from __future__ import annotations

import pytest

from turnkv_server.router.config import RouterConfig
from turnkv_server.router.sessions import LeasePolicy


def test_the_router_settings_lease_as_the_policy_does() -> None:
    """`--default-ttl` and `--max-ttl` are the lease policy's defaults, checked by it."""
    config = RouterConfig(mode="standard", prefill=["p"], decode=["d"])
    assert LeasePolicy(config.default_ttl, config.max_ttl) == LeasePolicy()
    with pytest.raises(ValueError, match="lease policy"):
        RouterConfig(mode="standard", prefill=["p"], decode=["d"], default_ttl=1000, max_ttl=900)

