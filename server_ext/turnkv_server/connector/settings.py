"""The connector's settings, and what it requires of the engine it runs in.

In ``kv_connector_extra_config`` unless said otherwise:

- the leases, the quarantine's cap, the transfers' timeouts and layer-by-layer writes:
  `ConnectorSettings`, each field under its own name, with its default and what it does;
- ``side_channel_host``/``side_channel_port``: where peers reach this engine (default: vLLM's
  ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``; neither port set: no side channel). Port 0
  binds a free port when the worker starts; with the environment variable
  ``TURNKV_SIDE_CHANNEL_REPORT`` naming a file, the worker writes the "host:port" it bound
  there (whole: written, then renamed), for whoever launched the engine;
- the side channel's secret, shared by every engine of a cluster, which signs every
  side-channel message: the environment variable ``TURNKV_SIDE_CHANNEL_SECRET``, or
  ``side_channel_secret_file``, a file holding it (surrounding whitespace ignored), such as a
  mounted Kubernetes secret. Never the secret itself in this config: vLLM logs the whole
  ``--kv-transfer-config`` among its non-default arguments at startup, so a connector given
  ``side_channel_secret`` refuses to start, and says where to put it instead. Without a
  secret the worker refuses to start.

The engine's ``kv_load_failure_policy`` (the outer config's under ``MultiConnector``) must be
``recompute``: every way a turnkv receive can end without its KV (refused, late, given up)
relies on vLLM computing the prompt instead, and under vLLM's default, ``fail``, each would
reach the client as an error. The scheduler's connector checks the policy vLLM's scheduler
adopted (`require_recompute`) and refuses to start otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

from turnkv_server.connector.cluster_secret import check_secret

SECRET_ENV = "TURNKV_SIDE_CHANNEL_SECRET"
SECRET_FILE_SETTING = "side_channel_secret_file"
REPORT_ENV = "TURNKV_SIDE_CHANNEL_REPORT"
# Names under which a secret would be logged with vLLM's configuration.
_LOGGED_SECRET_SETTINGS = ("side_channel_secret",)


def flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() not in ("0", "false", "no")


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings in ``kv_connector_extra_config``, each under its field's name,
    declared here once: the parts built from them (`leases.LeaseLimits`, `SchedulerSide`,
    `TransferAgent`) default to these."""

    # The lease a session gets without a TTL hint, and the operator's cap on any.
    lease_ttl_s: float = 300.0
    lease_max_ttl_s: float = 900.0
    # The share of the cache leases may hold.
    max_pinned_fraction: float = 0.5
    # The share of the cache that blocks of given-up receives may hold (a late write may still
    # land in them) before this engine stops starting receives and computes prompts itself.
    max_quarantined_fraction: float = 0.25
    # How long a transfer may take to start, receiving and sending.
    receive_timeout_s: float = 120.0
    send_timeout_s: float = 60.0
    # Write a prefill's KV layer by layer while it computes, when the receiver has registered
    # (CPU caches; a GPU cache gets one write at the end, see `worker_side`).
    layer_writes: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """The settings `extra` gives (as numbers, or strings from a shell), the defaults for
        the rest; other keys are other parts' (the side channel's, the tier's)."""
        types = get_type_hints(cls)
        given: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra:
                continue
            value = extra[f.name]
            try:
                given[f.name] = flag(value) if types[f.name] is bool else float(value)
            except (TypeError, ValueError):
                raise ValueError(f"turnkv: kv_connector_extra_config.{f.name} must be a "
                                 f"number, not {value!r}") from None
        return cls(**given)


def refuse_secret_in_config(extra: Mapping[str, Any]) -> None:
    """Refuse a config that carries the secret itself (vLLM has logged it already)."""
    for name in _LOGGED_SECRET_SETTINGS:
        if name in extra:
            raise ValueError(
                f"turnkv: kv_connector_extra_config.{name} is not read: vLLM writes the whole "
                f"--kv-transfer-config to its log at startup, so a secret there is in the log "
                f"(replace it). Remove it and give the engine the secret in the environment "
                f"variable {SECRET_ENV}, or name a file holding it in "
                f"kv_connector_extra_config.{SECRET_FILE_SETTING}")


def side_channel_secret(extra: Mapping[str, Any], environ: Mapping[str, str]) -> bytes:
    """The cluster's side-channel secret: the environment's, or the named file's; refused if
    it is short or a placeholder (`cluster_secret.check_secret`)."""
    refuse_secret_in_config(extra)
    secret = environ.get(SECRET_ENV)
    path = extra.get(SECRET_FILE_SETTING)
    if secret and path:
        raise ValueError(
            f"turnkv: the side channel's secret is given twice, in the environment variable "
            f"{SECRET_ENV} and in the file {path} ({SECRET_FILE_SETTING}): keep one")
    if path:
        try:
            secret = Path(str(path)).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"turnkv: cannot read the side channel's secret from {path} "
                             f"({SECRET_FILE_SETTING}): {exc.__class__.__name__}") from None
        if not secret:
            raise ValueError(f"turnkv: the side channel's secret file {path} is empty")
    if not secret:
        raise ValueError(
            f"turnkv: the KV side channel needs a secret shared by the cluster's engines: set "
            f"the environment variable {SECRET_ENV}, or name a file holding it in "
            f"kv_connector_extra_config.{SECRET_FILE_SETTING}")
    check_secret(secret.encode())
    return secret.encode()


def side_channel_listen(extra: Mapping[str, Any], environ: Mapping[str, str]
                        ) -> tuple[str, int] | None:
    """Where to bind the side channel (port 0: a free one), or None for no side channel."""
    host = extra.get("side_channel_host") or environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST",
                                                         "127.0.0.1")
    port = extra.get("side_channel_port")
    if port is None or port == "":  # 0 is a port: "bind a free one"
        port = environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if port is None or port == "":
        return None
    return str(host), int(port)


def require_recompute(recompute_kv_load_failures: bool) -> None:
    """Refuse an engine whose scheduler fails requests on a failed KV load."""
    if not recompute_kv_load_failures:
        raise ValueError(
            'turnkv: this engine\'s kv_load_failure_policy is "fail": every receive turnkv '
            "gives up (refused, late, or its sender lost) would reach the client as an error "
            'instead of being computed. Set "kv_load_failure_policy": "recompute" in '
            "--kv-transfer-config (the outer config, under MultiConnector)")
