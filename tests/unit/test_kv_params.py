"""The per-mode request rewriting, as pure functions."""

from __future__ import annotations

from connector.address import NixlAddress
from router.client_request import Endpoint
from router.pd import kv_params as kp

CLIENT = {
    "model": "tiny",
    "prompt": "hi",
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 50,
    "min_tokens": 5,
    "temperature": 0,
    "request_id": "client-chosen",
    "kv_transfer_params": {"remote_host": "evil"},
    "vendor_field": [1, 2],
}


def test_prefill_body_asks_for_one_token_without_streaming() -> None:
    body = kp.prefill_body(CLIENT, kp.prefill_params("xfer-1"))
    assert body["max_tokens"] == 1 and body["stream"] is False
    for dropped in ("stream_options", "min_tokens", "request_id"):
        assert dropped not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": "xfer-1",
    }
    assert body["vendor_field"] == [1, 2] and body["temperature"] == 0
    assert "max_completion_tokens" not in body


def test_prefill_body_caps_max_completion_tokens_only_when_present() -> None:
    chat = {"model": "m", "messages": [], "max_completion_tokens": 9, "min_completion_tokens": 2}
    body = kp.prefill_body(chat, kp.prefill_params("x"))
    assert body["max_completion_tokens"] == 1 and "min_completion_tokens" not in body


def test_client_body_is_never_mutated() -> None:
    before = repr(CLIENT)
    kp.prefill_body(CLIENT, kp.prefill_params("x"))
    kp.decode_body(CLIENT, {"a": 1})
    kp.aggregated_body(CLIENT)
    assert repr(CLIENT) == before


def test_decode_body_keeps_client_fields_and_replaces_routing_fields() -> None:
    body = kp.decode_body(CLIENT, {"do_remote_prefill": True})
    assert body["kv_transfer_params"] == {"do_remote_prefill": True}
    assert body["stream_options"] == {"include_usage": True} and body["min_tokens"] == 5
    assert body["max_tokens"] == 50 and "request_id" not in body
    assert "kv_transfer_params" not in kp.aggregated_body(CLIENT)


def test_pull_params_are_verbatim_except_reachable_host() -> None:
    p = {"remote_block_ids": [[1]], "remote_host": "0.0.0.0", "remote_engine_id": "e", "tp_size": 2}
    assert kp.pull_decode_params(p, "x", None) == {**p, "transfer_id": "x"}
    assert kp.pull_decode_params(p, "x", "10.1.1.1")["remote_host"] == "10.1.1.1"
    assert kp.pull_decode_params({**p, "transfer_id": "p"}, "x", None)["transfer_id"] == "p"


def test_push_params_carry_identity_and_no_block_ids() -> None:
    ident = NixlAddress("p0", "10.0.0.1", 5600, tp_size=2)
    params = kp.push_decode_params(ident, "cmpl-r-0", "xfer-9")
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
        "pp_size": 1,
        "remote_request_id": "cmpl-r-0",
        "transfer_id": "xfer-9",
    }


def test_predicted_prefill_request_id_per_endpoint() -> None:
    assert kp.predicted_prefill_request_id(Endpoint.CHAT, "abc") == "chatcmpl-abc"
    assert kp.predicted_prefill_request_id(Endpoint.COMPLETIONS, "abc") == "cmpl-abc-0"


def test_nixl_address_from_params() -> None:
    full = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 4}
    assert NixlAddress.from_params(full) == NixlAddress("e", "h", 1, 4, 1)
    assert NixlAddress.from_params(full, "override").host == "override"  # type: ignore[union-attr]
    assert NixlAddress.from_params({"remote_engine_id": "e"}) is None


def test_dispatch_ids_are_fresh() -> None:
    a, b = kp.new_dispatch_ids(), kp.new_dispatch_ids()
    assert a.request_id != b.request_id and a.transfer_id != b.transfer_id


CHAT_WITH_IDS = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "kv_transfer_params": {"prompt_token_ids": [5, 6, 7], "remote_host": "evil", "x": 1},
}


def test_a_chat_s_prompt_ids_reach_every_leg_and_nothing_else_of_the_client_s_params() -> None:
    p = kp.prefill_body(CHAT_WITH_IDS, kp.prefill_params("xfer-1"), Endpoint.CHAT)
    d = kp.decode_body(CHAT_WITH_IDS, {"do_remote_prefill": True})
    alone = kp.aggregated_body(CHAT_WITH_IDS)
    assert p["kv_transfer_params"] == {**kp.prefill_params("xfer-1"), "prompt_token_ids": [5, 6, 7]}
    assert d["kv_transfer_params"] == {"do_remote_prefill": True, "prompt_token_ids": [5, 6, 7]}
    assert alone["kv_transfer_params"] == {"prompt_token_ids": [5, 6, 7]}


def test_malformed_prompt_ids_are_passed_on_for_the_engines_to_refuse() -> None:
    chat = {**CHAT_WITH_IDS, "kv_transfer_params": {"prompt_token_ids": [-1, "a"]}}
    assert kp.aggregated_body(chat)["kv_transfer_params"] == {"prompt_token_ids": [-1, "a"]}


def test_prompt_ids_outside_a_chat_body_are_dropped_as_vllm_ignores_them() -> None:
    completion = {**CLIENT, "kv_transfer_params": {"prompt_token_ids": [5, 6]}}
    assert "prompt_token_ids" not in kp.decode_body(completion, {"a": 1})["kv_transfer_params"]
    assert "kv_transfer_params" not in kp.aggregated_body(completion)
    null_ids = {**CHAT_WITH_IDS, "kv_transfer_params": {"prompt_token_ids": None}}
    assert "kv_transfer_params" not in kp.aggregated_body(null_ids)
