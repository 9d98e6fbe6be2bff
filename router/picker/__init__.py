"""``pd-router picker``: the router as a Gateway API Inference Extension endpoint picker.

A gateway (Envoy, or any conformant one) asks the picker over ``ext_proc`` where each
request goes (extproc.py); the picker reserves the decode slot and chooses P and D with the
router's own context (router/context.py: ledger, fair queue, limits, bounds, KV index,
sessions, adaptive choice), names D in ``x-gateway-destination-endpoint`` and P in
``x-pd-prefill-endpoint``, and gives the slot back when the gateway reports the response's
end. ``pd-router sidecar`` (the router app with ``sidecar=True``) runs the legs next to D.
server.py serves it (gRPC, health checks) beside the router's HTTP app.
"""
