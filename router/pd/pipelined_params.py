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
rank. Where the two engines' configured tensor-parallel sizes differ, each leg also carries the
other engine's (``"tp_size"``, ``"pp_size"``): the connector then maps heads between them
(``connector/tp_map.py``). Without them it assumes the other engine's sizes equal its own, so
equal sizes (including both left at the default) send what they always did.

The rest of the P body is as in pull mode (``max_tokens=1``, ``stream=false``, no
``stream_options``/``min_tokens``). Neither leg depends on the other's response, and P's response
carries no parameters D needs.
"""

from __future__ import annotations

from connector.address import NixlAddress

__all__ = ["TRANSFER_MODE", "decode_params", "prefill_params"]

TRANSFER_MODE = "pipelined"


def _common(transfer_id: str, peer: NixlAddress, me: NixlAddress | None) -> dict[str, object]:
    unequal = me is not None and (me.tp_size, me.pp_size) != (peer.tp_size, peer.pp_size)
    params = peer.as_params(with_layout=unequal)
    return {"transfer_id": transfer_id, "transfer_mode": TRANSFER_MODE, **params}


def prefill_params(
    transfer_id: str, decode: NixlAddress, prefill: NixlAddress | None = None
) -> dict[str, object]:
    """``kv_transfer_params`` for the P leg: it names the D engine that P writes into (with
    D's parallel sizes where they differ from ``prefill``'s)."""
    common = _common(transfer_id, decode, prefill)
    return {"do_remote_decode": True, "do_remote_prefill": False, **common}


def decode_params(
    transfer_id: str, prefill: NixlAddress, decode: NixlAddress | None = None
) -> dict[str, object]:
    """``kv_transfer_params`` for the D leg: it names the P engine that will write D's blocks
    (with P's parallel sizes where they differ from ``decode``'s)."""
    common = _common(transfer_id, prefill, decode)
    return {"do_remote_decode": False, "do_remote_prefill": True, **common}
