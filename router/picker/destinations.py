"""Where the gateway sends a request the picker placed: the address of the sidecar
(``pd-router sidecar``) on the chosen D's pod, or of P itself when P serves alone."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from router.engines.instance import Instance, Role

__all__ = ["Destinations", "host_port"]


def host_port(url: str) -> str:
    """``host:port`` of an engine URL (the port its scheme implies when it names none)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Destinations:
    """A D's sidecar: the one ``explicit`` names for its URL, else D's host at
    ``sidecar_port`` (a sidecar container in D's pod). A P (P alone): its own address."""

    def __init__(self, sidecar_port: int, explicit: Mapping[str, str]) -> None:
        self._port = sidecar_port
        self._explicit = dict(explicit)

    def of(self, inst: Instance) -> str:
        if inst.role is Role.PREFILL:
            return host_port(inst.url)
        given = self._explicit.get(inst.url)
        if given is not None:
            return given
        host = urlsplit(inst.url).hostname or ""
        return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"
