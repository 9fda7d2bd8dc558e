"""The connector's settings: each read once from the extra config, with one default; where the
side channel listens, and where its secret comes from."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from turnkv_server.connector.leases import LeaseLimits
from turnkv_server.connector.scheduler_side import SchedulerSide
from turnkv_server.connector.settings import (
    ConnectorSettings,
    side_channel_listen,
    side_channel_secret,
)
from turnkv_server.connector.transport import TransferAgent
from turnkv_server.tier import session_order

SECRET = "s3cr3t-" * 6
ENV = "TURNKV_SIDE_CHANNEL_SECRET"


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert side_channel_secret({}, {ENV: SECRET}) == SECRET.encode()
    mounted = tmp_path / "secret"
    mounted.write_text(SECRET + "\n")  # as `kubectl create secret --from-file` keeps it
    assert side_channel_secret({"side_channel_secret_file": str(mounted)}, {}) == (
        SECRET.encode())
    with pytest.raises(ValueError, match="twice"):
        side_channel_secret({"side_channel_secret_file": str(mounted)}, {ENV: SECRET})
    for bad in (tmp_path / "missing", tmp_path):
        with pytest.raises(ValueError, match="cannot read") as err:
            side_channel_secret({"side_channel_secret_file": str(bad)}, {})
        assert str(bad) in str(err.value)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        side_channel_secret({"side_channel_secret_file": str(tmp_path / "empty")}, {})
    with pytest.raises(ValueError) as err:
        side_channel_secret({}, {})
    assert ENV in str(err.value) and "side_channel_secret_file" in str(err.value)


def test_a_short_or_placeholder_secret_is_refused_where_the_settings_are_read(
        tmp_path: Path) -> None:
    for weak in ("short", "REPLACE-ME-" + "x" * 40):
        with pytest.raises(ValueError, match="openssl rand") as err:
            side_channel_secret({}, {ENV: weak})
        assert weak not in str(err.value)
        mounted = tmp_path / "secret"
        mounted.write_text(weak)
        with pytest.raises(ValueError, match="openssl rand"):
            side_channel_secret({"side_channel_secret_file": str(mounted)}, {})


def test_a_secret_in_the_config_is_refused_and_never_repeated() -> None:
    # vLLM logs the whole --kv-transfer-config at startup: a secret there is in the log.
    for environ in ({}, {ENV: "other-" * 8}):
        with pytest.raises(ValueError) as err:
            side_channel_secret({"side_channel_secret": SECRET}, environ)
        message = str(err.value)
        assert SECRET not in message
        assert "log" in message and ENV in message and "side_channel_secret_file" in message


def test_port_0_binds_a_free_port_and_no_port_no_side_channel() -> None:
    assert side_channel_listen({"side_channel_port": 0}, {}) == ("127.0.0.1", 0)
    assert side_channel_listen({"side_channel_port": "0"}, {}) == ("127.0.0.1", 0)
    assert side_channel_listen({}, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "0"}) == ("127.0.0.1", 0)
    assert side_channel_listen({"side_channel_host": "10.0.0.2", "side_channel_port": 5600},
                               {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7"}) == ("10.0.0.2", 5600)
    assert side_channel_listen({}, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "h",
                                    "VLLM_NIXL_SIDE_CHANNEL_PORT": "7"}) == ("h", 7)
    assert side_channel_listen({}, {}) is None


def test_each_setting_is_read_from_the_extra_config_with_its_type() -> None:
    """vLLM hands the extra config over as JSON gave it: numbers, or strings from a shell."""
    given = ConnectorSettings.from_extra({
        "lease_ttl_s": 60, "lease_max_ttl_s": "120", "max_pinned_fraction": "0.25",
        "receive_timeout_s": 30, "layer_writes": "false", "side_channel_port": 0})
    assert given == ConnectorSettings(lease_ttl_s=60.0, lease_max_ttl_s=120.0,
                                      max_pinned_fraction=0.25, receive_timeout_s=30.0,
                                      layer_writes=False)
    assert ConnectorSettings.from_extra({}) == ConnectorSettings()
    with pytest.raises(ValueError, match="lease_ttl_s"):
        ConnectorSettings.from_extra({"lease_ttl_s": "soon"})


def test_the_parts_default_to_the_settings_defaults() -> None:
    """A part built without a setting (a test, the tier's policy) behaves as an engine whose
    extra config leaves it out: one default per setting."""
    defaults = ConnectorSettings()
    assert LeaseLimits() == LeaseLimits(defaults.lease_ttl_s, defaults.lease_max_ttl_s,
                                        defaults.max_pinned_fraction)
    init = inspect.signature(TransferAgent.__init__).parameters
    assert init["receive_timeout_s"].default == defaults.receive_timeout_s
    assert init["send_timeout_s"].default == defaults.send_timeout_s
    init = inspect.signature(SchedulerSide.__init__).parameters
    assert init["max_quarantined_fraction"].default == defaults.max_quarantined_fraction
    assert defaults.lease_ttl_s == session_order.DEFAULT_TTL_S
