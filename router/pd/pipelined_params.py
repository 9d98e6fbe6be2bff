"""``kv_transfer_params`` for the ``pipelined`` P/D mode (the project's own push connector).

In this mode the router dispatches both legs at once, with the same ``X-Request-Id`` and a fresh
``transfer_id`` per dispatch (fresh again on every retry). Each leg carries the *other* engine's
identity, so neither engine waits for the router:

P leg (``prefill_params``)::

    {"do_remote_decode": true, "do_remote_prefill": false,
     "transfer_id": "<id>",            # rendezvous key shared by both legs
     "transfer_mode": "pipelined",
     "remote_engine_id": "<D engine_id>", "remote_host": "<D side-channel host>",
     "remote_port": <D side-channel port>}

D leg (``decode_params``)::

    {"do_remote_decode": false, "do_remote_prefill": true,
     "transfer_id": "<id>", "transfer_mode": "pipelined",
     "remote_engine_id": "<P engine_id>", "remote_host": "<P side-channel host>",
     "remote_port": <P side-channel port>}

``remote_port`` is the base side-channel port of the engine; the connector adds the tensor-parallel
rank. The rest of the P body is as in pull mode (``max_tokens=1``, ``stream=false``, no
``stream_options``/``min_tokens``). Neither leg depends on the other's response, and P's response
carries no parameters D needs.
"""

from __future__ import annotations

from connector.address import NixlAddress

__all__ = ["TRANSFER_MODE", "decode_params", "prefill_params"]

TRANSFER_MODE = "pipelined"


def _common(transfer_id: str, peer: NixlAddress) -> dict[str, object]:
    return {"transfer_id": transfer_id, "transfer_mode": TRANSFER_MODE, **peer.as_params()}


def prefill_params(transfer_id: str, decode: NixlAddress) -> dict[str, object]:
    """``kv_transfer_params`` for the P leg: it names the D engine that P writes into."""
    return {"do_remote_decode": True, "do_remote_prefill": False, **_common(transfer_id, decode)}


def decode_params(transfer_id: str, prefill: NixlAddress) -> dict[str, object]:
    """``kv_transfer_params`` for the D leg: it names the P engine that will write D's blocks."""
    return {"do_remote_decode": False, "do_remote_prefill": True, **_common(transfer_id, prefill)}
