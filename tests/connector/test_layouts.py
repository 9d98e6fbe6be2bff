"""KV cache layouts, the handshake fields, worker names and ports, prepared descriptor lists.

Caches are built as vLLM 0.32's model runner builds them (``tests/connector/layouts.py``: one
buffer, strided ``[B, H, N, C]`` views per layer); P and D talk through the fake fabric, which
copies bytes, and the checks compare D's whole buffer with what it must hold.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from connector.address import NixlAddress
from connector.layout import CacheLayout, LayoutError, memory_type
from connector.metadata import (
    Compat,
    Kind,
    RecvSpec,
    SendSpec,
    StepMeta,
    WorkerRank,
    agent_name,
    decode,
    encode,
    engine_address,
)
from connector.peers import LinkState, PeerTable
from connector.worker import WorkerSide
from tests.connector.helpers import (
    D_ADDR,
    P_ADDR,
    Clock,
    Side,
    compat_fields,
    forward,
    idle,
    make_side,
)
from tests.connector.layouts import LAYOUTS, strided_caches
from tests.fakes.fake_nixl import Fabric, FakeAgent
from tests.needs import need_module

torch = need_module("torch")  # real tensors: needs the engine extra

LAYERS, HEADS, BLOCK_SIZE, HEAD_SIZE = 3, 2, 4, 4
WHOLE_BLOCKS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # a block of a layer is one piece
HEAD_OUTER = ("LHBNC", "BHLNC")  # a block is one piece per KV head


def caches(layout: str, blocks: int, heads: int = HEADS, **kw: Any) -> dict[str, Any]:
    return strided_caches(layout, LAYERS, blocks, heads, BLOCK_SIZE, 2 * HEAD_SIZE, **kw)


def side(
    fabric: Fabric,
    addr: NixlAddress,
    clock: Clock,
    kv: dict[str, Any],
    blocks: int,
    **compat: Any,
) -> Side:
    return make_side(fabric, addr, clock, caches=kv, blocks=blocks, **compat)


def randomise(kv: dict[str, Any], seed: int) -> None:
    """Random bytes in the whole buffer under ``kv``, padding included."""
    storage = next(iter(kv.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.int8).set_(storage)
    flat.copy_(torch.randint(-128, 128, flat.shape, generator=torch.Generator().manual_seed(seed)))


def raw(kv: dict[str, Any]) -> Any:
    return torch.empty(0, dtype=torch.int8).set_(next(iter(kv.values())).untyped_storage())


def blocks_of(view: Any, blocks: int) -> Any:
    """The view with manager blocks as the first axis (kernel blocks grouped, as vLLM does)."""
    return view.unflatten(0, (blocks, -1))


def transfer(p: Side, d: Side, p_ids: list[int], d_ids: list[int], tokens: int) -> None:
    forward(d, StepMeta(recvs=[RecvSpec("d1", "t1", P_ADDR, 0, d_ids, 0)]))
    for _ in range(3):  # handshake
        idle(p)
        idle(d)
    forward(p, StepMeta(sends=[SendSpec("p1", "t1", D_ADDR, 0, p_ids, tokens, True)]))
    _, finished, failed = idle(d)
    assert finished == {"d1"} and failed == set()


# -- layouts ----------------------------------------------------------------------------------


CASES = [
    *[(name, HEADS, {}) for name in WHOLE_BLOCKS],
    *[(name, 1, {}) for name in LAYOUTS],  # one KV head (MLA's latent): every layout is whole
    ("LBNHC", HEADS, {"kernel_ratio": 2}),  # kernel blocks of half a block
    ("LBHNC", HEADS, {"block_stride_bytes": 1024}),  # padded pages (page: 256 B)
]


@pytest.mark.parametrize(("layout", "heads", "extra"), CASES)
def test_an_accepted_layout_moves_exactly_the_blocks_written(
    layout: str, heads: int, extra: dict[str, Any]
) -> None:
    """P (16 blocks) and D (24 blocks, so every address differs) in one layout: after the
    transfer, D's buffer equals what it held with P's blocks copied in, byte for byte: the
    blocks, per layer, and nothing else (no other block, layer, padding)."""
    fabric, clock = Fabric(), Clock()
    p_kv, d_kv = caches(layout, 16, heads, **extra), caches(layout, 24, heads, **extra)
    randomise(p_kv, 1)
    randomise(d_kv, 2)
    expected = caches(layout, 24, heads, **extra)
    raw(expected).copy_(raw(d_kv))
    p_ids, d_ids = [3, 4, 5, 9], [20, 2, 3, 11]
    for name in p_kv:
        blocks_of(expected[name], 24)[d_ids] = blocks_of(p_kv[name], 16)[p_ids]
    p = side(fabric, P_ADDR, clock, p_kv, 16, kv_layout=layout)
    d = side(fabric, D_ADDR, clock, d_kv, 24, kv_layout=layout)
    transfer(p, d, p_ids, d_ids, tokens=4 * BLOCK_SIZE)
    assert torch.equal(raw(d_kv), raw(expected))
    assert len(fabric.writes_to(d.name)) == LAYERS  # one WRITE per layer


@pytest.mark.parametrize("layout", HEAD_OUTER)
def test_a_head_outer_layout_is_refused_at_registration_saying_what_to_set(layout: str) -> None:
    agent = Fabric().agent("pdr-x-tp0", 1)
    worker = WorkerSide(
        agent,
        engine_id="x",
        tp_rank=0,
        host="h",
        port=1,
        compat_fields=compat_fields(kv_layout=layout),
    )
    kv = caches(layout, 16)
    view = next(iter(kv.values()))
    with pytest.raises(ValueError) as err:
        worker.register_kv_caches(kv, 16)
    msg = str(err.value)
    assert f"layout {layout}" in msg
    assert f"shape {tuple(view.shape)}, strides {tuple(view.stride())}" in msg
    assert "VLLM_KV_CACHE_LAYOUT=LBHNC" in msg and "--attention-backend" in msg
    assert agent.regions == []  # nothing registered


def test_a_view_that_is_not_blocks_is_refused() -> None:
    """vLLM before 0.32 had ``(2, num_blocks, ...)`` (K/V outermost) on CUDA; and a first axis
    that is not the blocks (or their kernel blocks) cannot be written."""
    kv_first = torch.zeros(2, 16, 4, 2, 8)
    with pytest.raises(LayoutError, match="first axis is not 16 blocks"):
        CacheLayout.from_tensors([kv_first], 16, "DRAM")
    k_and_v_apart = torch.zeros(2, 16, 4, 16).transpose(0, 1)  # a block: K here, V far away
    with pytest.raises(LayoutError, match="not one contiguous piece"):
        CacheLayout.from_tensors([k_and_v_apart], 16, "DRAM")


def test_layers_must_share_one_geometry() -> None:
    kv = caches("LBHNC", 16)
    names = list(kv)
    kv[names[1]] = caches("LBNHC", 16)[names[1]]
    with pytest.raises(LayoutError, match="layers differ"):
        CacheLayout.from_tensors(list(kv.values()), 16, "DRAM")


def test_the_whole_buffer_is_registered_once() -> None:
    fabric = Fabric()
    p = side(fabric, P_ADDR, Clock(), caches("BLHNC", 16), 16, kv_layout="BLHNC")
    storage = next(iter(p.caches.values())).untyped_storage()
    assert p.agent.regions == [((storage.data_ptr(), storage.nbytes(), 0), "DRAM")]


def test_a_bad_block_id_from_a_peer_fails_the_send_without_writing() -> None:
    fabric, clock = Fabric(), Clock()
    p = make_side(fabric, P_ADDR, clock)
    d = make_side(fabric, D_ADDR, clock, fill=0.0)
    forward(d, StepMeta(recvs=[RecvSpec("d1", "t1", P_ADDR, 0, [16], 0)]))  # D has 0..15
    for _ in range(3):
        idle(p)
        idle(d)
    forward(p, StepMeta(sends=[SendSpec("p1", "t1", D_ADDR, 0, [1], 4, True)]))
    assert fabric.writes_to(d.name) == []
    assert p.worker.stats.take()["failures"] == {"write_error": 1}  # type: ignore[index]


# -- memory type and kv_buffer_device ---------------------------------------------------------


def test_memory_type_follows_the_cache_and_checks_kv_buffer_device() -> None:
    assert memory_type("cpu", "cpu") == memory_type("cpu", None) == "DRAM"
    assert memory_type("cuda", "cuda") == memory_type("cuda", None) == "VRAM"
    with pytest.raises(ValueError, match="host memory, which PipelinedPushConnector does not"):
        memory_type("cuda", "cpu")
    with pytest.raises(ValueError, match=r"requires the KV cache on cuda, but it is on cpu"):
        memory_type("cpu", "cuda")


def test_kv_buffer_device_cuda_with_a_cpu_cache_is_refused_at_registration() -> None:
    agent = Fabric().agent("pdr-x-tp0", 1)
    worker = WorkerSide(
        agent,
        engine_id="x",
        tp_rank=0,
        host="h",
        port=1,
        compat_fields=compat_fields(),
        kv_buffer_device="cuda",
    )
    with pytest.raises(ValueError, match='set "kv_buffer_device": "cpu"'):
        worker.register_kv_caches(caches("LBHNC", 16), 16)
    assert agent.regions == []


# -- handshake ------------------------------------------------------------------------------


def compat(**over: Any) -> Compat:
    fields = {**compat_fields(), "num_layers": LAYERS, "block_bytes": 256, "mem_type": "DRAM"}
    fields["dtype"] = "torch.float32"
    fields.update(over)
    return Compat(**fields)


def handshake(
    p_compat: Compat, d_compat: Compat, versions: tuple[str, str] = ("0.34.0", "0.34.0")
) -> tuple[Any, Any]:
    """Two peer tables on the fake fabric exchange HELLOs (P's and D's vLLM ``versions``);
    their links to each other."""
    fabric, clock = Fabric(), Clock()
    p_agent, d_agent = fabric.agent("pdr-p-tp0", 7000), fabric.agent("pdr-d-tp0", 7100)
    tables = {}
    sides = (
        (p_agent, p_compat, "p", 7000, versions[0]),
        (d_agent, d_compat, "d", 7100, versions[1]),
    )
    for agent, mine, eid, port, vllm in sides:
        hello = {"compat": _asdict(mine), "engine_id": eid, "host": "h", "port": port,
                 "vllm_version": vllm}  # fmt: skip
        tables[agent.name] = PeerTable(agent, WorkerRank(), hello, mine, 5.0, clock)
    tables[p_agent.name].ensure(NixlAddress("d", "h", 7100))
    tables[d_agent.name].ensure(NixlAddress("p", "h", 7000))
    for _ in range(3):
        for agent in (p_agent, d_agent):
            tables[agent.name].poll()
            for sender, raws in agent.get_notifs().items():
                for raw_msg in raws:
                    msg = decode(raw_msg)
                    assert msg is not None
                    tables[agent.name].on_message(sender, msg)
    return tables[p_agent.name].get("pdr-d-tp0"), tables[d_agent.name].get("pdr-p-tp0")


def _asdict(c: Compat) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(c)


MISMATCHES = [
    ("attn_backend", "FLASH_ATTN", "FLASHINFER"),
    ("kv_layout", "LBNHC", "LBHNC"),
    ("mem_type", "DRAM", "VRAM"),
    ("dtype", "torch.bfloat16", "torch.float16"),
    ("kv_cache_dtype", "fp8_e4m3", "fp8_e5m2"),
    ("use_mla", False, True),
    ("pp_size", 1, 2),
    ("dp_size", 1, 2),
    ("dcp_size", 1, 2),
]


@pytest.mark.parametrize(("field", "p_value", "d_value"), MISMATCHES)
def test_a_mismatch_is_refused_and_both_logs_name_both_values(
    field: str, p_value: Any, d_value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="vllm.connector.peers")
    to_d, to_p = handshake(compat(**{field: p_value}), compat(**{field: d_value}))
    assert to_d.state is LinkState.REFUSED and to_p.state is LinkState.REFUSED
    assert to_d.layout is None and to_p.layout is None
    both = f"{field}: pdr-p-tp0={p_value!r} pdr-d-tp0={d_value!r}"
    both_from_d = f"{field}: pdr-d-tp0={d_value!r} pdr-p-tp0={p_value!r}"
    for me, peer in (("pdr-p-tp0", "pdr-d-tp0"), ("pdr-d-tp0", "pdr-p-tp0")):
        # Each engine's own error line (P's and D's log) names the peer and both values.
        lines = [r.getMessage() for r in caplog.records if f"refusing peer {peer}:" in r.message]
        assert lines, f"{me} logged no refusal"
        assert all(both in line or both_from_d in line for line in lines)


def test_a_refusal_names_both_vllm_versions_in_both_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The pipelined handshake pairs vLLM releases (it compares its own wire and the cache's
    shape), but when it refuses, each engine's line says what both sides run."""
    caplog.set_level(logging.ERROR, logger="vllm.connector.peers")
    to_d, to_p = handshake(compat(block_size=16), compat(block_size=64), ("0.33.0", "0.34.0"))
    assert to_d.state is LinkState.REFUSED and to_p.state is LinkState.REFUSED
    for peer in ("pdr-d-tp0", "pdr-p-tp0"):
        lines = [r.getMessage() for r in caplog.records if f"refusing peer {peer}:" in r.message]
        assert lines and all("0.33.0" in line and "0.34.0" in line for line in lines), lines
        assert all("block_size" in line for line in lines)


def test_engines_of_different_vllm_releases_pair() -> None:
    to_d, to_p = handshake(compat(), compat(), ("0.32.0", "0.34.0"))
    assert to_d.state is LinkState.READY and to_p.state is LinkState.READY


def test_matching_peers_are_ready_with_each_others_layout() -> None:
    layout = CacheLayout((4096, 8192, 12288), 8, 256, 256, 0, "DRAM")
    c = compat()
    fabric, clock = Fabric(), Clock()
    a, b = fabric.agent("pdr-p-tp0", 7000), fabric.agent("pdr-d-tp0", 7100)
    hello = {"compat": _asdict(c), "layout": layout.to_wire(), "engine_id": "d", "host": "h"}
    table = PeerTable(a, WorkerRank(), {"compat": _asdict(c)}, c, 5.0, clock)
    table.ensure(NixlAddress("d", "h", 7100))
    link = table.on_message(b.name, decode(encode(Kind.HELLO, **hello, port=7100)))  # type: ignore[arg-type]
    assert link is not None and link.state is LinkState.READY and link.layout == layout


def test_a_layout_contradicting_its_compat_is_malformed() -> None:
    c = compat()
    bad = CacheLayout((1, 2), 8, 256, 256, 0, "DRAM")  # two layers, Compat says three
    fabric, clock = Fabric(), Clock()
    a = fabric.agent("pdr-p-tp0", 7000)
    table = PeerTable(a, WorkerRank(), {"compat": _asdict(c)}, c, 5.0, clock)
    msg = decode(encode(Kind.HELLO, compat=_asdict(c), layout=bad.to_wire()))
    link = table.on_message("pdr-d-tp0", msg)  # type: ignore[arg-type]
    assert link is not None and link.state is LinkState.REFUSED and "malformed" in link.reason


def test_worker_mismatch_is_refused_before_any_write() -> None:
    """Through the workers: a refused peer gets no WRITE, and D's receive fails."""
    fabric, clock = Fabric(), Clock()
    p = make_side(fabric, P_ADDR, clock, attn_backend="FLASH_ATTN")
    d = make_side(fabric, D_ADDR, clock, fill=0.0, attn_backend="FLASHINFER")
    forward(d, StepMeta(recvs=[RecvSpec("d1", "t1", P_ADDR, 0, [10], 0)]))
    forward(p, StepMeta(sends=[SendSpec("p1", "t1", D_ADDR, 0, [1], 4, True)]))
    failed: set[str] = set()
    for _ in range(4):
        idle(p)
        failed |= idle(d)[2]
    assert failed == {"d1"} and fabric.writes_to(d.name) == []


# -- names and ports --------------------------------------------------------------------------


def test_every_worker_of_every_data_parallel_rank_has_its_own_name_and_port() -> None:
    tp, pp, dp = 2, 2, 2
    seen: set[tuple[str, int]] = set()
    for dp_index in range(dp):
        engine_id, port = engine_address("eng", 6600, dp_index, dp, tp * pp)
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                rank = WorkerRank(tp_rank, pp_rank, tp)
                seen.add((rank.agent_name(engine_id), port + rank.index))
    assert len(seen) == tp * pp * dp
    assert len({name for name, _ in seen}) == len({port for _, port in seen}) == tp * pp * dp


def test_one_worker_engines_keep_their_names_and_ports() -> None:
    assert engine_address("eng", 6600, 0, 1, 1) == ("eng", 6600)
    assert WorkerRank().agent_name("eng") == agent_name("eng", 0) == "pdr-eng-tp0"
    assert engine_address("eng_dp1", 6600, 1, 2, 4) == ("eng_dp1", 6604)  # vLLM's suffix kept
    assert engine_address("eng", 6600, 1, 2, 4) == ("eng_dp1", 6604)
    assert engine_address("eng", 6600, 1, 1, 4) == ("eng_dp1", 6604)  # dense: DP size 1 in workers


@pytest.mark.parametrize(("tp_rank", "pp_rank"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_a_peer_reaches_the_worker_of_the_same_place(tp_rank: int, pp_rank: int) -> None:
    """D's workers listen where ``_build_worker`` puts them; P's worker at one place derives
    the name and port of D's worker at that place from D's address alone."""
    fabric, clock = Fabric(), Clock()
    engine_id, port = engine_address("dec", 6700, 1, 2, 4)
    agents = {}
    for pp in range(2):
        for tp in range(2):
            rank = WorkerRank(tp, pp, 2)
            agents[(tp, pp)] = fabric.agent(rank.agent_name(engine_id), port + rank.index)
    p_agent = fabric.agent("pdr-pre-tp0", 6600)
    c = compat(tp_size=2, pp_size=2)
    table = PeerTable(p_agent, WorkerRank(tp_rank, pp_rank, 2), {"compat": {}}, c, 5.0, clock)
    link = table.ensure(NixlAddress(engine_id, "h", port))
    assert link.name == agents[(tp_rank, pp_rank)].name
    assert p_agent.has_remote(link.name)  # the fake loads metadata only from the right port


# -- prepared descriptor lists ----------------------------------------------------------------


def test_descriptor_lists_are_prepared_once_per_peer_not_per_write() -> None:
    fabric, clock = Fabric(), Clock()
    p = make_side(fabric, P_ADDR, clock)
    d = make_side(fabric, D_ADDR, clock, fill=0.0)
    assert fabric.preps == 2  # each side's own list, at registration
    forward(d, StepMeta(recvs=[RecvSpec("d1", "t1", P_ADDR, 0, [10, 11, 12, 13], 0)]))
    for _ in range(3):
        idle(p)
        idle(d)
    for i in range(4):
        spec = SendSpec("p1", "t1", D_ADDR, i, [1 + i], 4 * (i + 1), i == 3)
        forward(p, StepMeta(sends=[spec]))
    assert len(fabric.writes_to(d.name)) == 4 * LAYERS
    assert fabric.preps == 3  # plus D's list, once, at P's first WRITE
    assert idle(d)[1] == {"d1"}


def test_a_peers_new_layout_is_prepared_again_and_the_old_list_released() -> None:
    from connector.writer import BlockWriter

    fabric = Fabric()
    p = fabric.agent("pdr-p-tp0", 1)
    d = fabric.agent("pdr-d-tp0", 2)
    p_kv, d_kv = caches("LBHNC", 8), caches("LBHNC", 8)
    for agent, kv in ((p, p_kv), (d, d_kv)):
        tensors = list(kv.values())
        agent.register([(tensors[0].untyped_storage().data_ptr(), raw(kv).numel(), 0)], "DRAM")
    p.known.add(d.name)
    local = CacheLayout.from_tensors(list(p_kv.values()), 8, "DRAM")
    first = CacheLayout.from_tensors(list(d_kv.values()), 8, "DRAM")
    again = CacheLayout.from_wire(first.to_wire())  # the same peer's next HELLO
    writer = BlockWriter(p, local)
    writer.write(d.name, first, 0, [1], [2], b"")
    writer.write(d.name, first, 1, [1], [2], b"")
    assert fabric.preps == 2
    writer.write(d.name, again, 0, [1], [2], b"")
    assert fabric.preps == 3 and [x.released for x in p.prepped] == [False, True, False]
    writer.close()
    assert all(x.released for x in p.prepped)


def test_shutdown_releases_the_lists_and_deregisters_the_cache() -> None:
    fabric, clock = Fabric(), Clock()
    p = make_side(fabric, P_ADDR, clock)
    registered = list(p.agent.regions)
    p.worker.shutdown()
    assert p.agent.regions == [] and p.agent.deregistered == registered
    assert all(x.released for x in p.agent.prepped) and p.agent.closed


# -- what vLLM is told and what the handshake compares ------------------------------------------


# Importing vLLM emits torch deprecation warnings that are not ours.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_the_connector_pins_one_layout_and_fills_every_compat_field() -> None:
    need_module("vllm")
    from connector.connector import PINNED_LAYOUT, PipelinedPushConnector, compat_fields

    assert PINNED_LAYOUT == "LBHNC"
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="m",
            use_mla=False,
            get_num_kv_heads=lambda parallel: 2,
            get_head_size=lambda: 64,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=2,
            pipeline_parallel_size=3,
            data_parallel_size=4,
            decode_context_parallel_size=1,
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="fp8", kv_cache_layout="LBNHC"),
    )
    assert PipelinedPushConnector.get_required_kvcache_layout(config) == "LBHNC"
    assert PipelinedPushConnector.get_required_kvcache_layout(SimpleNamespace()) is None
    fields = compat_fields(config, SimpleNamespace(kv_cache_layout=None), ["FLASH_ATTN"], {})
    from_cache = {"num_layers", "block_bytes", "dtype", "mem_type"}
    assert set(fields) | from_cache == set(_asdict(compat())) and not set(fields) & from_cache
    full = Compat(**fields, num_layers=2, block_bytes=1, dtype="x", mem_type="VRAM")
    assert (full.kv_layout, full.attn_backend, full.kv_cache_dtype) == (
        "LBNHC",
        "FLASH_ATTN",
        "fp8",
    )
    assert (full.tp_size, full.pp_size, full.dp_size, full.dcp_size) == (2, 3, 4, 1)


def test_fake_agents_refuse_lists_outside_registered_memory() -> None:
    """The fake holds the line real NIXL holds: a list over unregistered memory fails."""
    agent: FakeAgent = Fabric().agent("a", 1)
    agent.register([(4096, 1024, 0)], "DRAM")
    agent.prep_blocks(None, [(4096, 128, 0, 128, 8)], "DRAM")
    with pytest.raises(RuntimeError, match="registered"):
        agent.prep_blocks(None, [(4096, 128, 0, 128, 9)], "DRAM")
    with pytest.raises(RuntimeError, match="registered"):
        agent.prep_blocks(None, [(4096, 128, 0, 128, 8)], "VRAM")


@pytest.mark.parametrize(
    ("layout", "ratio", "heads_outermost"),
    [
        ("LBHNC", 1, True),
        ("BLHNC", 1, True),
        ("LBNHC", 1, False),
        ("BLNHC", 1, False),
        ("LBHNC", 2, False),
    ],
)
def test_head_bytes_only_where_a_run_of_heads_is_one_piece(
    layout: str, ratio: int, heads_outermost: bool
) -> None:
    """Unequal TP sizes write runs of heads: possible only where the head axis is a block's
    outermost (HND layouts without kernel blocks); else ``head_bytes`` is 0."""
    caches = strided_caches(layout, 2, 4, 4, 8, 6, kernel_ratio=ratio)
    lay = CacheLayout.from_tensors(list(caches.values()), 4, "DRAM")
    assert lay.head_bytes == (lay.block_bytes // 4 if heads_outermost else 0)
    one = strided_caches(layout, 2, 4, 1, 8, 6)  # one head (MLA's latent): the whole block
    assert (
        CacheLayout.from_tensors(list(one.values()), 4, "DRAM").head_bytes == lay.block_bytes // 4
    )
