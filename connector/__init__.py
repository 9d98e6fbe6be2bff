"""vLLM KV-connector plugin for pd-router (loaded through ``kv_connector_module_path``).

``PipelinedPushConnector`` is resolved lazily so that importing the pure modules (wire format,
scheduler logic) does not import vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONNECTOR_VERSION", "PipelinedPushConnector"]

from connector.metadata import CONNECTOR_VERSION


def __getattr__(name: str) -> Any:
    if name == "PipelinedPushConnector":
        from connector.connector import PipelinedPushConnector

        return PipelinedPushConnector
    raise AttributeError(name)
