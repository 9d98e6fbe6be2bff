"""LoRA adapters as the engines list them, and what a request's ``model`` says of them.

vLLM lists every adapter it holds in ``GET /v1/models`` as a model card of its own, beside the
base model's: ``id`` the adapter's name, ``root`` the path it was loaded from, ``parent`` the
base model's id (vLLM 0.32, ``vllm/entrypoints/openai/models/serving.py``,
``OpenAIServingModels.show_available_models``: ``ModelCard(id=lora.lora_name,
root=lora.path, parent=lora.base_model_name or base_model_paths[0].name)``); a base model's
card has no ``parent``. The same list changes at run time (``POST /v1/load_lora_adapter``,
``/v1/unload_lora_adapter``, a resolver plugin), so the router reads it again, never on a
request's path (router/engines/facts.py).

A request names an adapter by putting its name in ``model``; the engine then applies it. The
legs keep that name: the router only chooses engines that hold it (router/registry.py).
Pure functions and values here: no engine state, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["OTHER", "Adapter", "AdapterLabels", "parse_adapters", "requested_adapter"]

OTHER = "other"  # the adapter label of every adapter past the cap


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter card: ``name`` (its ``id``), ``parent`` (the base model's id) and
    ``root`` (where the engine loaded it from; None if the card has none)."""

    name: str
    parent: str
    root: str | None = None

    def card(self, parent: str) -> dict[str, Any]:
        """Its ``/v1/models`` card as the router lists it, under ``parent`` (the router's
        name of the base model, which is the engines' served name)."""
        return {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "pd-router",
            "root": self.root,
            "parent": parent,
        }


def parse_adapters(body: bytes) -> dict[str, Adapter] | None:
    """The adapters of a ``/v1/models`` answer, by name (empty: it lists none); None when the
    body is not a model list (the caller keeps what it knew)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list):
        return None
    found: dict[str, Adapter] = {}
    for card in cards:
        if not isinstance(card, dict):
            continue
        name, parent, root = card.get("id"), card.get("parent"), card.get("root")
        if isinstance(name, str) and name and isinstance(parent, str) and parent:
            found[name] = Adapter(name, parent, root if isinstance(root, str) else None)
    return found


def requested_adapter(model: str, body: Mapping[str, Any]) -> str | None:
    """The adapter a request of the model named ``model`` asks for: its body's ``model``
    when that is not the base model's name; None for the base model (or no ``model``)."""
    named = body.get("model")
    return named if isinstance(named, str) and named != model else None


class AdapterLabels:
    """The ``adapter`` label of a model's adapter requests: each of the first ``cap``
    adapters seen per model gets its own, every later one :data:`OTHER`, so that clients
    naming adapters cannot grow the metric without bound. Only adapters an engine holds are
    labelled (the caller's rule), so names a client invents never take a place."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}

    def label(self, model: str, adapter: str, cap: int) -> str:
        seen = self._seen.setdefault(model, set())
        if adapter in seen:
            return adapter
        if len(seen) < cap:
            seen.add(adapter)
            return adapter
        return OTHER
