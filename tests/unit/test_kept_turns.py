"""The kept-turn table (router/engines/kept_turns.py), the reuse check
(router/pd/kept_turn_params.py)."""

from __future__ import annotations

import json

from router.config import KeptTurnsConfig
from router.engines.kept_turns import KeptTurn, KeptTurnResult, KeptTurnTable
from router.engines.vllm_versions import streams_params
from router.pd.kept_turn_params import kept_from_response, kept_from_stream, reuse_params

PARAMS = {"do_remote_decode": True, "remote_block_ids": [[7, 8, 9], [17, 18, 19]]}


def _kept(ids: list[int]) -> KeptTurn:
    return KeptTurn({**PARAMS, "remote_num_tokens": len(ids)}, tuple(ids), "http://d", 10.0)


def test_whole_history_reused_as_is() -> None:
    result, params = reuse_params(_kept(list(range(40))), [*range(40), 1, 2], 16, 8)
    assert result is KeptTurnResult.REUSED and params == {**PARAMS, "remote_num_tokens": 40}


def test_common_prefix_names_its_blocks_only_in_every_group() -> None:
    prompt = [*range(20), 99, 98, 97]  # differs at token 20: two blocks of 16, one partial
    result, params = reuse_params(_kept(list(range(40))), prompt, 16, 8)
    assert result is KeptTurnResult.PARTIAL and params is not None
    assert params["remote_num_tokens"] == 20
    assert params["remote_block_ids"] == [[7, 8], [17, 18]]


def test_p_always_computes_the_last_prompt_token() -> None:
    # The new prompt is exactly what D holds (a resent turn): one token is left to compute.
    result, params = reuse_params(_kept(list(range(40))), list(range(40)), 16, 8)
    assert result is KeptTurnResult.PARTIAL and params is not None
    assert params["remote_num_tokens"] == 39 and params["remote_block_ids"][0] == [7, 8, 9]


def test_short_common_prefix_and_unknown_block_size_are_not_reused() -> None:
    assert reuse_params(_kept(list(range(40))), [*range(5), 50, 51], 16, 8) == (
        KeptTurnResult.MISMATCH,
        None,
    )
    assert reuse_params(_kept(list(range(40))), [*range(20), 99], None, 8) == (
        KeptTurnResult.UNAVAILABLE,
        None,
    )


def test_table_hands_out_once_expires_and_stays_bounded() -> None:
    now = [0.0]
    table = KeptTurnTable(lambda: now[0])
    cfg = KeptTurnsConfig(enabled=True, ttl_seconds=5, max_entries=2)
    for session in ("a", "b", "c"):
        table.keep(cfg, session, PARAMS, [1, 2], "http://d")
    assert len(table) == 2 and table.take("a") is None  # the oldest went first
    assert isinstance(table.take("b"), KeptTurn) and table.take("b") is None
    now[0] = 5.0
    assert table.take("c") is KeptTurnResult.EXPIRED and len(table) == 0


def test_kept_from_response_cuts_ids_at_what_d_holds_and_hides_them() -> None:
    doc = {
        "choices": [{"index": 0, "text": "xy", "token_ids": [5, 6], "prompt_token_ids": [1, 2]}],
        "kv_transfer_params": {**PARAMS, "remote_num_tokens": 3},
        "usage": {"prompt_tokens": 2},
        "seed_echo": 2**70,
    }
    found, body = kept_from_response(json.dumps(doc).encode(), client_wants_ids=False)
    assert found == ({**PARAMS, "remote_num_tokens": 3}, [1, 2, 5])
    out = json.loads(body)
    assert out["kv_transfer_params"] is None and out["seed_echo"] == 2**70
    assert out["choices"] == [{"index": 0, "text": "xy"}]


def test_kept_from_response_without_params_only_hides_the_ids() -> None:
    doc = {"choices": [{"index": 0, "text": "xy", "token_ids": [5]}], "kv_transfer_params": None}
    found, body = kept_from_response(json.dumps(doc).encode(), client_wants_ids=False)
    assert found is None and json.loads(body)["choices"] == [{"index": 0, "text": "xy"}]


def test_a_streamed_turn_is_kept_with_the_prompt_s_ids_and_reused_up_to_them() -> None:
    """D's params from a 0.33+ stream hold prompt and reply (40 tokens); the router knows
    only the prompt's 30 ids (P's), so the next turn reads at most those, as a partial."""
    raw = json.dumps({**PARAMS, "remote_num_tokens": 40}).encode()
    found = kept_from_stream(raw, list(range(30)))
    assert found is not None
    params, ids = found
    kept = KeptTurn(params, tuple(ids), "http://d", 10.0)
    result, reuse = reuse_params(kept, [*range(30), 500, 501, 502], 16, 8)
    assert result is KeptTurnResult.PARTIAL and reuse is not None
    assert reuse["remote_num_tokens"] == 30 and reuse["remote_block_ids"][0] == [7, 8]
    assert kept_from_stream(b'{"do_remote_decode": false}', [1, 2]) is None
    assert kept_from_stream(b"not json", [1, 2]) is None


def test_only_engines_of_0_33_on_end_their_streams_with_params() -> None:
    assert [streams_params(v) for v in ("0.32.0", "0.33.0", "0.34.1+cu128", None)] == [
        False,
        True,
        True,
        False,
    ]
