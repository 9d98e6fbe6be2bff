"""vLLM KV-connector plugin for pd-router (loaded through ``kv_connector_module_path``)."""

__all__: list[str] = []
