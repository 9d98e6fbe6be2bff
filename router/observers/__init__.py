"""The observers of the request's lifecycle (router/lifecycle.py): metrics, tracing."""
