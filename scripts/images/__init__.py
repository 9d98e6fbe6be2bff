"""The container image checks driven by ``scripts/test-images.sh``: podman helpers (shared with
the router image tests) and the compose stack's check."""
