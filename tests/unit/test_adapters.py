"""LoRA adapters as vLLM lists them (router/engines/adapters.py): the cards of a /v1/models
answer, the adapter a request names, and the bounded label set of its metric."""

from __future__ import annotations

import orjson

from router.engines.adapters import OTHER, Adapter, AdapterLabels, parse_adapters, requested_adapter


def test_adapters_are_the_cards_with_a_parent() -> None:
    """vLLM 0.32's /v1/models: the base model's card (no parent), then one per adapter."""
    doc = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "root": "/models/base", "parent": None},
            {"id": "sql", "object": "model", "root": "/adapters/sql", "parent": "base"},
            {"id": "chat", "object": "model", "parent": "base"},
            {"id": "", "parent": "base"},
            "not a card",
        ],
    }
    assert parse_adapters(orjson.dumps(doc)) == {
        "sql": Adapter("sql", "base", "/adapters/sql"),
        "chat": Adapter("chat", "base", None),
    }
    assert parse_adapters(b'{"object": "list", "data": []}') == {}


def test_an_answer_that_is_not_a_model_list_says_nothing() -> None:
    for body in (b"", b"not json", b"[]", b'{"data": 3}'):
        assert parse_adapters(body) is None


def test_a_request_names_an_adapter_when_its_model_is_not_the_base_model() -> None:
    assert requested_adapter("base", {"model": "sql"}) == "sql"
    assert requested_adapter("base", {"model": "base"}) is None
    assert requested_adapter("base", {}) is None
    assert requested_adapter("base", {"model": 3}) is None


def test_the_first_adapters_seen_keep_their_label_per_model() -> None:
    labels = AdapterLabels()
    assert [labels.label("m", a, 2) for a in ("a", "b", "c", "a", "c")] == [
        "a",
        "b",
        OTHER,
        "a",
        OTHER,
    ]
    assert labels.label("n", "c", 2) == "c"  # another model has its own places
    assert labels.label("m", "z", 0) == OTHER
