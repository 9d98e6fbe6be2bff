"""Local real-engine stack: tiny model, vLLM P/D engines with NIXL, the router, and the demo.

Engine-side dependencies (``vllm``, ``torch``, ``transformers``) are imported lazily, so
importing this package needs only the router's own dependencies.
"""

from router.config import Mode
from router.stack.engines import EngineSpec
from router.stack.launcher import ExtraRouter, RouterSettings, Stack, StackError
from router.stack.metrics import MetricsPage, scrape
from router.stack.model import cache_root, ensure_model
from router.stack.routed import RoutedStack

__all__ = [
    "EngineSpec",
    "ExtraRouter",
    "MetricsPage",
    "Mode",
    "RoutedStack",
    "RouterSettings",
    "Stack",
    "StackError",
    "cache_root",
    "ensure_model",
    "scrape",
]
