"""The session-aware router: OpenAI-compatible HTTP in front of prefill and decode pools."""

from turnkv_server.router.app import Router, create_app
from turnkv_server.router.config import ROUTER_MODES, RouterConfig

__all__ = ["ROUTER_MODES", "Router", "RouterConfig", "create_app"]
