"""Wire format, compatibility check, layout and descriptor building."""

from __future__ import annotations

import json

from connector.address import NixlAddress
from connector.layout import CacheLayout, block_runs, write_descs
from connector.metadata import CONNECTOR_VERSION, Compat, Kind, decode, encode
from router.pd.pipelined_params import decode_params, prefill_params
from tests.needs import need_module


def test_roundtrip_keeps_kind_tid_and_body() -> None:
    msg = decode(encode(Kind.REG, "t1", start=2, blocks=[5, 6]))
    assert msg is not None
    assert (msg.kind, msg.tid, msg.body) == ("REG", "t1", {"start": 2, "blocks": [5, 6]})
    assert msg.kind is Kind.REG


def test_encoding_is_the_version_2_wire_format() -> None:
    """The kinds are an enum in code, plain strings on the wire (version 2 added the kept
    turns' ASK/HELD/PULL to version 1's)."""
    assert CONNECTOR_VERSION == 2
    assert encode(Kind.REG, "t1", start=2, blocks=[5, 6]) == (
        b'PDR{"v":2,"t":"REG","tid":"t1","start":2,"blocks":[5,6]}'
    )
    assert encode(Kind.DONE, "t1", writes=3, tokens=10) == (
        b'PDR{"v":2,"t":"DONE","tid":"t1","writes":3,"tokens":10}'
    )
    assert encode(Kind.HELD, "t1", tokens=5, hashes=["ab"]) == (
        b'PDR{"v":2,"t":"HELD","tid":"t1","tokens":5,"hashes":["ab"]}'
    )
    assert encode(Kind.REFUSE, reason="x") == b'PDR{"v":2,"t":"REFUSE","tid":"","reason":"x"}'
    wire = {"HELLO", "REFUSE", "REG", "W", "DONE", "FAIL", "ABORT", "ASK", "HELD", "PULL"}
    assert {k.value for k in Kind} == wire | {"VERSION"}
    for kind in wire:
        raw = b'PDR{"v":2,"t":"%s","tid":"t"}' % kind.encode()
        assert decode(raw) == decode(encode(Kind(kind), "t"))
        assert decode(raw).kind is Kind(kind)  # type: ignore[union-attr]


def test_foreign_notifications_are_ignored() -> None:
    assert decode(b"HB:req-1") is None
    assert decode(b"PDRnot json") is None
    assert decode(b'PDR{"v":2,"t":"NEW","tid":"x"}') is None  # no handler for it


def test_other_version_is_reported_not_parsed() -> None:
    raw = b"PDR" + json.dumps({"v": CONNECTOR_VERSION + 1, "t": "REG", "tid": "x"}).encode()
    msg = decode(raw)
    assert msg is not None and msg.kind == "VERSION" and msg.body["v"] == CONNECTOR_VERSION + 1


def test_compat_lists_each_mismatch() -> None:
    a = Compat(1, "m", "bf16", 128, 2, 2, 64, 1, 4096)
    b = Compat(1, "m", "bf16", 16, 2, 2, 64, 2, 4096)
    bad = a.mismatches(b)
    assert len(bad) == 2 and bad[0].startswith("block_size") and bad[1].startswith("tp_size")
    assert a.mismatches(a) == []


def test_runs_merge_only_when_both_sides_are_consecutive() -> None:
    assert block_runs([1, 2, 3, 7], [10, 11, 12, 13]) == [(1, 10, 3), (7, 13, 1)]
    assert block_runs([1, 2], [5, 9]) == [(1, 5, 1), (2, 9, 1)]


def test_cpu_layout_one_segment_and_descs() -> None:
    torch = need_module("torch")
    t = torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16)
    lay = CacheLayout.from_tensors([t, t.clone()], 8, "DRAM")
    assert lay.block_bytes == lay.block_stride == 2 * 4 * 16 * 2
    src, dst = write_descs(lay, lay, 1, [(2, 5, 3)])
    assert src == [(lay.layers[1].segments[0] + 2 * lay.block_bytes, 3 * lay.block_bytes, 0)]
    assert dst[0][0] == lay.layers[1].segments[0] + 5 * lay.block_bytes


def test_kv_first_layout_has_two_segments() -> None:
    torch = need_module("torch")
    t = torch.zeros(2, 8, 4, 16)
    lay = CacheLayout.from_tensors([t], 8, "DRAM")
    assert len(lay.layers[0].segments) == 2
    assert lay.layers[0].segments[1] - lay.layers[0].segments[0] == 8 * lay.block_stride
    assert CacheLayout.from_wire(lay.to_wire()) == lay


def test_router_params_carry_the_other_engine() -> None:
    d = NixlAddress("decode-0", "10.0.0.2", 6700)
    p = NixlAddress("prefill-0", "10.0.0.1", 6600)
    pp, dp = prefill_params("x1", d), decode_params("x1", p)
    assert pp["do_remote_decode"] is True and dp["do_remote_prefill"] is True
    assert NixlAddress.from_params(pp) == NixlAddress("decode-0", "10.0.0.2", 6700)
    assert NixlAddress.from_params(dp) == NixlAddress("prefill-0", "10.0.0.1", 6600)
    assert pp["transfer_id"] == dp["transfer_id"] == "x1"
