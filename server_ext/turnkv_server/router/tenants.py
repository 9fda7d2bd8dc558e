"""Tenants: who a request is (its API key), whether it may see the admin routes, its cache salt,
and what its clients may ask of the leases that every tenant's sessions share (`TenantCaps`).

Why caps. Each engine ends leases for room in one order over every tenant's sessions
(`connector/leases.py`): the session expected back last goes first, then the lowest priority,
then the least recently used, and a session late for its announced return keeps its place
until its TTL ends it. So two hints a client sends reorder other tenants' sessions: a short
`next_turn_in` (a session "back in 0 s" is kept over everyone expected later, and stays so
for its whole TTL if it never comes) and a high `priority` (which orders the leases without a
hint, most clients', and the router's own full session table). Only the router knows tenants,
so it holds every hint to the tenant's caps before anything orders by it: the operator sets the
highest priority a tenant's clients may ask for (by default the same for every tenant: none
orders its sessions above another's) and the shortest return they may announce. Clients may
only lower their priority and lengthen their announced return, as SGLang's TTL rule lets them
only shorten the operator's cap.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from turnkv.protocol import MAX_PRIORITY, MAX_TTL_SECONDS, MIN_PRIORITY, CacheHints, TurnTag

# The one tenant of a router without API keys.
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantCaps:
    """What one tenant's clients may ask: a priority at most `max_priority`, a next turn no
    sooner than `min_next_turn_in` seconds."""

    max_priority: int = 0
    min_next_turn_in: float = 0.0

    def __post_init__(self) -> None:
        if not MIN_PRIORITY <= self.max_priority <= MAX_PRIORITY:
            raise ValueError(f"max_priority must be in {MIN_PRIORITY}..{MAX_PRIORITY}, not "
                             f"{self.max_priority}")
        if not 0 <= self.min_next_turn_in <= MAX_TTL_SECONDS:
            raise ValueError(f"min_next_turn_in must be in 0..{MAX_TTL_SECONDS:.0f} s, not "
                             f"{self.min_next_turn_in}")

    def apply(self, hints: CacheHints) -> CacheHints:
        """`hints` held to the caps: a priority above the cap lowered to it (no priority counts
        as 0, so below a negative cap it becomes the cap), an announced return sooner than the
        floor put off to it; the rest as sent."""
        changes: dict[str, Any] = {}
        priority = hints.priority
        if (0 if priority is None else priority) > self.max_priority:
            changes["priority"] = self.max_priority
        if hints.next_turn_in is not None and hints.next_turn_in < self.min_next_turn_in:
            changes["next_turn_in"] = self.min_next_turn_in
        return hints.model_copy(update=changes) if changes else hints


# Caps that change no hint a client may send (`CacheHints` allows no more).
UNCAPPED = TenantCaps(MAX_PRIORITY, 0.0)


def default_max_priority(keyed: bool) -> int:
    """The priority cap of a tenant the operator set none for: 0 where API keys make several
    tenants (none above another; clients may still lower theirs), none without keys (one
    tenant, nobody else to push out)."""
    return 0 if keyed else MAX_PRIORITY


CAP_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "max_priority": ((int,), "an integer"),
    "min_next_turn_in": ((int, float), "a number of seconds"),
}


def load_tenant_caps(path: str) -> dict[str, dict[str, Any]]:
    """`--tenant-caps FILE`: a JSON object of tenant name -> its caps, each field optional
    (`{"acme": {"max_priority": 5, "min_next_turn_in": 2}}`); the router's defaults fill in
    the rest (`RouterConfig.caps_for`)."""
    with open(path) as f:
        caps = json.load(f)
    if not isinstance(caps, dict):
        raise SystemExit(f"{path}: expected a JSON object of tenant -> caps")
    for tenant, fields in caps.items():
        if not isinstance(fields, dict):
            raise SystemExit(f"{path}: {tenant}: expected an object of caps")
        for name, value in fields.items():
            if name not in CAP_FIELDS:
                raise SystemExit(f"{path}: {tenant}: unknown cap {name!r}; the caps are "
                                 f"{', '.join(CAP_FIELDS)}")
            kinds, kind = CAP_FIELDS[name]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise SystemExit(f"{path}: {tenant}: {name} must be {kind}")
    return caps


class Tenants:
    """API keys, the admin key, and each tenant's cache salt and caps."""

    def __init__(self, api_keys: Mapping[str, str], admin_key: str | None = None,
                 caps_for: Callable[[str], TenantCaps] | None = None) -> None:
        """`caps_for`: each tenant's caps (`RouterConfig.caps_for`; default: the default cap
        for every tenant)."""
        self._keys = dict(api_keys)
        self._admin_key = admin_key
        default = TenantCaps(default_max_priority(bool(self._keys)))
        self._caps_for = caps_for or (lambda tenant: default)
        # What a request needs of this class, known once: without keys there is one tenant,
        # which nothing authenticates or salts, and whose hints only the operator's caps
        # change; the app reads the tenant per request only where either is in play.
        self.enforced = bool(self._keys)
        self.sole_tenant = None if self.enforced else DEFAULT_TENANT
        self.caps_hints = self.enforced or self._caps_for(DEFAULT_TENANT) != UNCAPPED
        # Each tenant's caps, as `caps_for` made them on its first hint (they never change).
        self._caps: dict[str, TenantCaps] = {}
        # Salts are not derivable from tenant names by a client. Per process, unless routers
        # share one (`use_secret`, from the session store).
        self._secret = secrets.token_bytes(32)

    def use_secret(self, secret: bytes) -> None:
        """Salt with `secret`, which every router of a deployment shares: a tenant's cached
        prefixes then match whichever router serves it."""
        self._secret = secret

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

    def tenant_of(self, headers: Mapping[str, str], key_header: str | None = None) -> str | None:
        """The tenant of a request by its headers: the bearer key of its `Authorization`, else
        the key in `key_header` where its API's clients send it there (Anthropic's send
        `x-api-key`, or, given a token, a bearer token as OpenAI's do)."""
        key = headers.get(key_header) if key_header is not None else None
        return self.tenant_for(headers.get("authorization") or (f"Bearer {key}" if key else None))

    def is_admin(self, authorization: str | None) -> bool:
        if self._admin_key is None:
            return not self._keys  # an open router has open admin routes
        key = _bearer(authorization)
        return key is not None and hmac.compare_digest(self._admin_key, key)

    def cache_salt(self, tenant: str, client_salt: str | None) -> str:
        digest = hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
        return digest if not client_salt else f"{digest}:{client_salt}"

    def capped(self, tenant: str, hints: CacheHints) -> CacheHints:
        """`hints` from one of `tenant`'s clients, held to its caps."""
        caps = self._caps.get(tenant)
        if caps is None:
            caps = self._caps[tenant] = self._caps_for(tenant)
        return caps.apply(hints)

    def capped_tag(self, tenant: str, tag: TurnTag | None) -> TurnTag | None:
        if tag is None:
            return None
        hints = self.capped(tenant, tag.hints)
        return tag if hints is tag.hints else tag.model_copy(update={"hints": hints})


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None
