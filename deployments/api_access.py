"""Who may call the API: digests of the accepted keys, made once where the app is built.

An API key never goes further than that. Serve builds the app in a task on the head, whose
environment holds the keys (`api_keys_env`, from a Secret); the build hashes each, and the
ingress replicas, on whichever nodes, get only the digests (`ApiAccess`), not the keys and not
the need for the keys' environment. A presented token is hashed the same way and compared with
every digest in constant time; the first 32 hex digits of its digest name its tenant
(`owner_of`), which owns its jobs, its idempotency keys and its edit templates.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError

SALT = b"stepserve-tenant:"


def token_digest(token: bytes) -> str:
    return hashlib.sha256(SALT + token).hexdigest()


def key_digest(api_key: str) -> str:
    """An API key's digest (of its UTF-8 bytes)."""
    return token_digest(api_key.encode())


def owner_of(api_key: str) -> str:
    """The tenant of an API key: a digest of it, never the key."""
    return key_digest(api_key)[:32]


@dataclass(frozen=True)
class ApiAccess:
    """The digests of the API keys (`api_keys` and those in `api_keys_env`) and of the keys for
    `/metrics` only (`metrics_api_keys`; none: the API keys). No digest at all: auth is off."""

    keys: tuple[str, ...] = ()
    metrics_keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: AppConfig) -> "ApiAccess":
        """Resolved here: `api_keys_env` is read from this process's environment."""
        keys = tuple(key_digest(k) for k in config.resolved_api_keys())
        return cls(keys, tuple(key_digest(k) for k in config.metrics_api_keys) or keys)

    def owner(self, authorization: str, metrics: bool = False) -> str | None:
        """The tenant an `Authorization` header names (`owner_of` its key), or None when no key
        is asked for; a 401 `APIError` without a valid `Bearer <key>` (for `/metrics`: one of
        the metrics keys)."""
        digests = self.metrics_keys if metrics else self.keys
        if not digests:
            return None
        scheme, _, token = authorization.partition(" ")
        # The header's own bytes (Starlette decoded them as latin-1), against keys hashed from
        # their UTF-8. Every digest is compared (no early exit), so the time says nothing of which.
        given = token_digest(token.encode("latin-1", "replace"))
        matched = [d for d in digests if hmac.compare_digest(given, d)]
        if scheme.lower() != "bearer" or not matched:
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return matched[0][:32]
