"""Where an engine's KV connector is reached over NIXL: the one address type of the project.

The router keeps one per engine (configured, or learned from P's responses in push mode) and
writes it into ``kv_transfer_params``; vLLM's NIXL connectors and this project's connector read it
back from there. Only the standard library is imported: router and engines share this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["NixlAddress"]


@dataclass(frozen=True, slots=True)
class NixlAddress:
    """An engine's KV ``engine_id`` and NIXL side channel (plus its parallel layout).

    ``port`` is the engine's side-channel port: its worker at ``metadata.WorkerRank`` index
    ``pp_rank * tp_size + tp_rank`` listens on ``port + index`` (a data-parallel rank is an
    engine of its own, with its own id and port: ``metadata.engine_address``).
    """

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def from_params(cls, params: dict[str, Any], host: str | None = None) -> NixlAddress | None:
        """The ``remote_*`` fields of ``kv_transfer_params`` (``tp_size``/``pp_size`` when
        present); None if the engine id, host or port is missing or mistyped. ``host``
        replaces ``remote_host``: an engine may advertise a bind address peers cannot reach.
        """
        engine_id = params.get("remote_engine_id")
        host = host or params.get("remote_host")
        port = params.get("remote_port")
        if not isinstance(engine_id, str) or not isinstance(host, str):
            return None
        if not isinstance(port, int) or isinstance(port, bool):
            return None
        return cls(
            engine_id, host, port, _size(params.get("tp_size")), _size(params.get("pp_size"))
        )

    def of_rank(self, rank: int, port_step: int = 1) -> NixlAddress:
        """Data-parallel rank ``rank`` of the engine this address names as ``vllm serve`` was
        given it (its ``engine_id`` and side-channel port): vLLM names the rank
        ``<engine_id>_dp<rank>`` and offsets its side-channel port by ``rank x port_step``
        (vLLM's NIXL connectors: 1; this project's connector: the rank's TP x PP workers,
        ``metadata.engine_address``)."""
        return NixlAddress(
            f"{self.engine_id}_dp{rank}",
            self.host,
            self.port + rank * port_step,
            self.tp_size,
            self.pp_size,
        )

    def as_params(self, *, with_layout: bool = False) -> dict[str, Any]:
        """The ``remote_*`` fields naming this engine (and its layout, for vLLM's push)."""
        out: dict[str, Any] = {
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
        }
        if with_layout:
            out["tp_size"] = self.tp_size
            out["pp_size"] = self.pp_size
        return out


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1
