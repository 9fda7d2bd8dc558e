"""Tenants: API keys, and the cache salt that keeps their prefix caches apart.

vLLM hashes `cache_salt` into the first block's hash, so two tenants never hit each other's
cached prefixes even for identical prompts, and timing cannot reveal another tenant's prompts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

DEFAULT_TENANT = "default"


class Tenants:
    def __init__(self, api_keys: Mapping[str, str], admin_key: str | None = None) -> None:
        self._keys = dict(api_keys)
        self._admin_key = admin_key
        # Salts are not derivable from tenant names by a client. Per process, unless routers
        # share one (`use_secret`, from the session store).
        self._secret = secrets.token_bytes(32)

    def use_secret(self, secret: bytes) -> None:
        """Salt with `secret`, which every router of a deployment shares: a tenant's cached
        prefixes then match whichever router serves it."""
        self._secret = secret

    @property
    def enforced(self) -> bool:
        return bool(self._keys)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of a request, or None when keys are enforced and this one is unknown."""
        if not self._keys:
            return DEFAULT_TENANT
        key = _bearer(authorization)
        if key is None:
            return None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known, key):
                return tenant
        return None

    def is_admin(self, authorization: str | None) -> bool:
        if self._admin_key is None:
            return not self._keys  # an open router has open admin routes
        key = _bearer(authorization)
        return key is not None and hmac.compare_digest(self._admin_key, key)

    def cache_salt(self, tenant: str, client_salt: str | None) -> str:
        digest = hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
        return digest if not client_salt else f"{digest}:{client_salt}"


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None
