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


def test_encoding_is_the_version_3_wire_format() -> None:
    """The kinds are an enum in code, plain strings on the wire (version 2 added the kept
    turns' ASK/HELD/PULL to version 1's; version 3 the layout, backend, memory and parallel
    fields of HELLO's Compat)."""
    assert CONNECTOR_VERSION == 3
    assert encode(Kind.REG, "t1", start=2, blocks=[5, 6]) == (
        b'PDR{"v":3,"t":"REG","tid":"t1","start":2,"blocks":[5,6]}'
    )
    assert encode(Kind.DONE, "t1", writes=3, tokens=10) == (
        b'PDR{"v":3,"t":"DONE","tid":"t1","writes":3,"tokens":10}'
    )
    assert encode(Kind.HELD, "t1", tokens=5, hashes=["ab"]) == (
        b'PDR{"v":3,"t":"HELD","tid":"t1","tokens":5,"hashes":["ab"]}'
    )
    assert encode(Kind.REFUSE, reason="x") == b'PDR{"v":3,"t":"REFUSE","tid":"","reason":"x"}'
    wire = {"HELLO", "REFUSE", "REG", "W", "DONE", "FAIL", "ABORT", "ASK", "HELD", "PULL"}
    assert {k.value for k in Kind} == wire | {"VERSION"}
    for kind in wire:
        raw = b'PDR{"v":3,"t":"%s","tid":"t"}' % kind.encode()
        assert decode(raw) == decode(encode(Kind(kind), "t"))
        assert decode(raw).kind is Kind(kind)  # type: ignore[union-attr]


def test_foreign_notifications_are_ignored() -> None:
    assert decode(b"HB:req-1") is None
    assert decode(b"PDRnot json") is None
    assert decode(b'PDR{"v":3,"t":"NEW","tid":"x"}') is None  # no handler for it


def test_other_version_is_reported_not_parsed() -> None:
    raw = b"PDR" + json.dumps({"v": CONNECTOR_VERSION + 1, "t": "REG", "tid": "x"}).encode()
    msg = decode(raw)
    assert msg is not None and msg.kind == "VERSION" and msg.body["v"] == CONNECTOR_VERSION + 1


def _compat(**over: object) -> Compat:
    fields: dict[str, object] = {
        "version": 3,
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
    lay = CacheLayout((4096, 8192), 8, 256, 768, 1, "VRAM")
    assert CacheLayout.from_wire(json.loads(json.dumps(lay.to_wire()))) == lay


def test_router_params_carry_the_other_engine() -> None:
    d = NixlAddress("decode-0", "10.0.0.2", 6700)
    p = NixlAddress("prefill-0", "10.0.0.1", 6600)
    pp, dp = prefill_params("x1", d), decode_params("x1", p)
    assert pp["do_remote_decode"] is True and dp["do_remote_prefill"] is True
    assert NixlAddress.from_params(pp) == NixlAddress("decode-0", "10.0.0.2", 6700)
    assert NixlAddress.from_params(dp) == NixlAddress("prefill-0", "10.0.0.1", 6600)
    assert pp["transfer_id"] == dp["transfer_id"] == "x1"
