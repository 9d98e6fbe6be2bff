"""The observers of the request's lifecycle (router/lifecycle.py): what turns its events into
metrics, trace spans and access lines. Built into the app's one ``Lifecycle`` in
router/context.py; nothing on the request path imports them."""
