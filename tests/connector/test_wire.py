"""Wire format, the compatibility check, the layout in HELLO, the router's parameters."""

from __future__ import annotations

import json

from connector.address import NixlAddress
from connector.layout import CacheLayout
from connector.metadata import CONNECTOR_VERSION, Compat, Kind, decode, encode
from router.pd.pipelined_params import decode_params, prefill_params


def test_roundtrip_keeps_kind_tid_and_body() -> None:
    msg = decode(encode(Kind.REG, "t1", start=2, blocks=[5, 6]))
    assert msg is not None
    assert (msg.kind, msg.tid, msg.body) == ("REG", "t1", {"start": 2, "blocks": [5, 6]})
    assert msg.kind is Kind.REG


def test_encoding_is_the_version_4_wire_format() -> None:
    """The kinds are an enum in code, plain strings on the wire (version 2 added the kept
    turns' ASK/HELD/PULL to version 1's; version 3 the layout, backend, memory and parallel
    fields of HELLO's Compat; version 4 D's ACK)."""
    assert CONNECTOR_VERSION == 4
    assert encode(Kind.REG, "t1", start=2, blocks=[5, 6]) == (
        b'PDR{"v":4,"t":"REG","tid":"t1","start":2,"blocks":[5,6]}'
    )
    assert encode(Kind.DONE, "t1", writes=3, tokens=10) == (
        b'PDR{"v":4,"t":"DONE","tid":"t1","writes":3,"tokens":10}'
    )
    assert encode(Kind.HELD, "t1", tokens=5, hashes=["ab"]) == (
        b'PDR{"v":4,"t":"HELD","tid":"t1","tokens":5,"hashes":["ab"]}'
    )
    assert encode(Kind.REFUSE, reason="x") == b'PDR{"v":4,"t":"REFUSE","tid":"","reason":"x"}'
    wire = {"HELLO", "REFUSE", "REG", "W", "DONE", "FAIL", "ABORT", "ACK", "ASK", "HELD", "PULL"}
    assert {k.value for k in Kind} == wire | {"VERSION"}
    for kind in wire:
        raw = b'PDR{"v":4,"t":"%s","tid":"t"}' % kind.encode()
        assert decode(raw) == decode(encode(Kind(kind), "t"))
        assert decode(raw).kind is Kind(kind)  # type: ignore[union-attr]


def test_foreign_notifications_are_ignored() -> None:
    assert decode(b"HB:req-1") is None
    assert decode(b"PDRnot json") is None
    assert decode(b'PDR{"v":4,"t":"NEW","tid":"x"}') is None  # no handler for it


def test_other_version_is_reported_not_parsed() -> None:
    raw = b"PDR" + json.dumps({"v": CONNECTOR_VERSION + 1, "t": "REG", "tid": "x"}).encode()
    msg = decode(raw)
    assert msg is not None and msg.kind == "VERSION" and msg.body["v"] == CONNECTOR_VERSION + 1


def _compat(**over: object) -> Compat:
    fields: dict[str, object] = {
        "version": 4,
        "model": "m",
        "dtype": "torch.bfloat16",
        "block_size": 16,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_size": 64,
        "tp_size": 1,
        "block_bytes": 4096,
        "kv_layout": "LBHNC",
        "attn_backend": "FLASH_ATTN",
        "kv_cache_dtype": "auto",
        "mem_type": "VRAM",
        "use_mla": False,
        "pp_size": 1,
        "dp_size": 1,
        "dcp_size": 1,
    }
    fields.update(over)
    return Compat(**fields)  # type: ignore[arg-type]


def test_compat_lists_each_mismatch_with_both_engines_values() -> None:
    a = _compat()
    b = _compat(block_size=128, tp_size=2, attn_backend="FLASHINFER")
    bad = a.mismatches(b, "pdr-p-tp0", "pdr-d-tp0")
    assert bad == [
        "block_size: pdr-p-tp0=16 pdr-d-tp0=128",
        "tp_size: pdr-p-tp0=1 pdr-d-tp0=2",
        "attn_backend: pdr-p-tp0='FLASH_ATTN' pdr-d-tp0='FLASHINFER'",
    ]
    assert a.mismatches(a) == []


def test_layout_travels_in_hello_unchanged() -> None:
    lay = CacheLayout((4096, 8192), 8, 256, 768, 1, "VRAM", 128)
    assert CacheLayout.from_wire(json.loads(json.dumps(lay.to_wire()))) == lay


def test_router_params_carry_the_other_engine() -> None:
    d = NixlAddress("decode-0", "10.0.0.2", 6700)
    p = NixlAddress("prefill-0", "10.0.0.1", 6600)
    pp, dp = prefill_params("x1", d), decode_params("x1", p)
    assert pp["do_remote_decode"] is True and dp["do_remote_prefill"] is True
    assert NixlAddress.from_params(pp) == NixlAddress("decode-0", "10.0.0.2", 6700)
    assert NixlAddress.from_params(dp) == NixlAddress("prefill-0", "10.0.0.1", 6600)
    assert pp["transfer_id"] == dp["transfer_id"] == "x1"


def test_router_params_name_the_other_engines_sizes_only_where_they_differ() -> None:
    """Equal sizes (both at the default too) send what they always did, and the connector
    takes the other engine's size for its own; unequal ones name it (the head map needs it)."""
    from connector.scheduler import TransferParams

    d1 = NixlAddress("decode-0", "10.0.0.2", 6700)
    p1 = NixlAddress("prefill-0", "10.0.0.1", 6600)
    same = prefill_params("x1", d1, p1)
    assert "tp_size" not in same and same == prefill_params("x1", d1)
    parsed = TransferParams.parse("r1", same)
    assert parsed is not None and parsed.peer.tp_size == 0  # 0: the same as this engine's
    d2 = NixlAddress("decode-0", "10.0.0.2", 6700, tp_size=2)
    to_p, to_d = prefill_params("x1", d2, p1), decode_params("x1", p1, d2)
    assert (to_p["tp_size"], to_d["tp_size"]) == (2, 1)
    parsed_p, parsed_d = TransferParams.parse("r1", to_p), TransferParams.parse("r2", to_d)
    assert parsed_p is not None and parsed_p.peer == d2
    assert parsed_d is not None and parsed_d.peer == p1


def test_unequal_tp_sizes_pair_when_their_heads_map() -> None:
    from connector.tp_map import pair_mismatches

    p = _compat(num_kv_heads=4, block_bytes=4096)  # TP 1: 4 heads of 1024 B a block
    d = _compat(tp_size=2, num_kv_heads=2, block_bytes=2048)
    assert pair_mismatches(p, d, "p", "d", 1024, 1024) == []
    assert pair_mismatches(p, p, "p", "d", 0, 0) == []  # equal sizes: Compat's check alone
    bad = pair_mismatches(
        p, _compat(tp_size=2, num_kv_heads=2, block_bytes=4096), "p", "d", 1024, 2048
    )
    assert bad == ["bytes per KV head of a block: p=1024 d=2048"]
    bad = pair_mismatches(p, _compat(tp_size=3, num_kv_heads=2, block_bytes=2048), "p", "d", 1, 1)
    assert bad[0].startswith("tp_size: p=1 d=3: 4 KV heads do not divide among 3 workers")
    assert "KV heads in all (per worker x TP): p=4 d=6" in bad[1]
    bad = pair_mismatches(p, d, "p", "d", 1024, 0)
    assert len(bad) == 1 and "head axis outermost in a block" in bad[0]
    mla = _compat(use_mla=True, num_kv_heads=1, block_bytes=1152)
    assert (
        pair_mismatches(
            mla, _compat(use_mla=True, num_kv_heads=1, block_bytes=1152, tp_size=4), "p", "d", 0, 0
        )
        == []
    )
