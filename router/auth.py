"""Who is asking: the client's API key, named, checked in constant time.

The rule (README, "Security"): every route needs a key when keys are configured, except
the probes in :data:`OPEN_PATHS`, which kubelets and load balancers call without
credentials. Only ``Authorization: Bearer <key>`` is accepted (the scheme's case aside,
RFC 9110); any other scheme is refused as if no key had been sent.

Keys are kept as SHA-256 digests and a presented key is compared with every one of them
by :func:`hmac.compare_digest`: equal-length inputs, no early exit, so neither timing nor
the number of comparisons says which key (if any) matched or how long keys are. The
router knows a client by the key's *name* from then on (metrics, logs, fairness); the key
itself is never logged or shown.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from router.config import AuthConfig
from router.errors import Unauthorized

__all__ = ["ANONYMOUS", "OPEN_PATHS", "Authenticator"]

ANONYMOUS = "anonymous"  # every client, when no key is configured

# Liveness and readiness probes: no credentials in a kubelet's or load balancer's probe.
# /ready without a key answers its status only (its detail names the engines).
OPEN_PATHS = frozenset({"/health", "/ready"})

_BEARER = b"bearer"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self._keys = [
            (_digest(k.key.get_secret_value().encode()), k.name) for k in config.named_keys()
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def names(self) -> list[str]:
        """Every key's name (``anonymous`` alone without keys)."""
        return [name for _, name in self._keys] or [ANONYMOUS]

    def identify(self, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """The name of the key in ``headers`` (raw ASGI headers); ``anonymous`` when no
        key is configured. Raises :class:`Unauthorized` (reason ``missing``, ``scheme``
        or ``invalid``)."""
        if not self._keys:
            return ANONYMOUS
        value = None
        for name, raw in headers:
            if name == b"authorization":
                value = raw
                break
        if value is None:
            raise Unauthorized("missing")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != _BEARER:
            raise Unauthorized("scheme")
        given = _digest(token.strip())
        found = None
        for digest, key_name in self._keys:
            # Every key is compared, whichever matches: the time taken is the same.
            if hmac.compare_digest(given, digest):
                found = key_name
        if found is None:
            raise Unauthorized("invalid")
        return found
