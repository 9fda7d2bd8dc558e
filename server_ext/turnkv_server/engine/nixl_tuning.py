"""vLLM's own NIXL connectors, with NIXL's progress thread tuned for CPU hosts (`nixl_poll`)
and a side channel that can bind a free port.

vLLM imports this module in each of its processes when it is named as
``kv_connector_module_path``; importing it patches NIXL before any agent exists. The upstream
modes (`standard`, `bidirectional`, `push`) run through it.

The connector classes are upstream's, under the same names (vLLM's checks go by the configured
name, and these are subclasses), with one addition: ``VLLM_NIXL_SIDE_CHANNEL_PORT=0`` makes
the handshake listener bind a port the kernel picks, and the port it got is reported to the
file named by ``TURNKV_SIDE_CHANNEL_REPORT`` (`turnkv_server.ports`). Upstream has no port 0:
it would listen on the port it was given, chosen by someone else minutes earlier.

How, in vLLM 0.32: the listener (a ZeroMQ ROUTER socket in a thread of the scheduler's
connector, in the engine core process) is started by ``set_xfer_handshake_metadata_pp_aware``,
which the engine core calls once the model and KV caches are up, before the engine reports
ready; it binds ``connector_scheduler.side_channel_port``, the same attribute the scheduler
puts in every request's ``kv_transfer_params`` as ``remote_port``. Here that attribute is set
to a port bound a moment before (port 0, held without listening, `PortHold`); the listener's
bind shares it (ZeroMQ sets SO_REUSEADDR; nothing that does not is let in), and the hold is
released once upstream's method returns, which it does only after the listener has bound.
So the port is never unbound between its choice and the listener's bind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from turnkv_server.engine.nixl_poll import POLL_DELAY_ENV, apply_poll_delay
from turnkv_server.ports import SIDE_CHANNEL_REPORT_ENV, PortHold, write_report

apply_poll_delay()

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnector as _UpstreamNixlConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlPushConnector as _UpstreamNixlPushConnector,
)

PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"


@contextlib.contextmanager
def side_channel_port(scheduler: Any) -> Iterator[None]:
    """Around starting upstream's handshake listener: bind a free port first if the configured
    one is 0, and report the port the listener serves on."""
    if scheduler is None:  # a worker-role connector: it serves no side channel
        yield
        return
    if os.environ.get(PORT_ENV, "").strip() != "0":
        yield
        _report(scheduler.side_channel_host, scheduler.side_channel_port)
        return
    parallel = scheduler.vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        # Upstream gives data-parallel rank i the port PORT + i; ranks of one engine cannot
        # each pick their own and share one report.
        raise ValueError(f"{PORT_ENV}=0 (a free port) needs data_parallel_size 1")
    host = scheduler.side_channel_host
    with PortHold(host, [0]) as hold:
        (port,) = hold.ports
        scheduler.side_channel_port = port
        yield
    _report(host, port)


def _report(host: str, port: int) -> None:
    path = os.environ.get(SIDE_CHANNEL_REPORT_ENV)
    if path:
        write_report(path, host, port)


class NixlConnector(_UpstreamNixlConnector):
    """Upstream's pull connector (`standard`, `bidirectional`); side channel on a free port."""

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        with side_channel_port(self.connector_scheduler):
            super().set_xfer_handshake_metadata_pp_aware(metadata)


class NixlPushConnector(_UpstreamNixlPushConnector):
    """Upstream's push connector (`push`); side channel on a free port."""

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        with side_channel_port(self.connector_scheduler):
            super().set_xfer_handshake_metadata_pp_aware(metadata)


__all__ = ["NixlConnector", "NixlPushConnector", "POLL_DELAY_ENV", "side_channel_port"]
