"""No WRITE before the device wrote the KV: P's marks, held and released by the test.

vLLM calls ``save_kv_layer`` / ``wait_for_save`` once kernels are *launched*; on a GPU the KV
is written later. ``HeldReadiness`` plays the device: a mark is ready when the test releases it.
The fake fabric copies bytes when a WRITE completes (here: when it is posted), so a WRITE posted
too early carries what the cache held before the "kernel" ran.
"""

from __future__ import annotations

from typing import Any

import pytest

from connector.kept_turns import prefix_hashes
from connector.metadata import KeepSpec, Kind, RecvSpec, SendSpec, StepMeta, decode
from connector.readiness import CudaReadiness, HostReadiness, Readiness, readiness_for
from tests.connector.fake_readiness import HeldReadiness
from tests.connector.helpers import (
    D_ADDR,
    LAYERS,
    P_ADDR,
    Clock,
    Side,
    forward,
    idle,
    make_side,
)
from tests.fakes.fake_nixl import Fabric
from tests.needs import need_module

torch = need_module("torch")  # real tensors: needs the engine extra

P_IDS, D_IDS = [1, 2], [10, 11]


def pair(readiness: Readiness, write_per_layer: bool = True) -> tuple[Fabric, Side, Side]:
    """P (with ``readiness``) and D, handshake done and D's REG for "t1" known to P."""
    fabric, clock = Fabric(), Clock()
    p = make_side(fabric, P_ADDR, clock, readiness=readiness, write_per_layer=write_per_layer)
    d = make_side(fabric, D_ADDR, clock, fill=0.0)
    forward(d, StepMeta(recvs=[RecvSpec("d1", "t1", P_ADDR, 0, D_IDS, 0)]))
    for _ in range(3):
        idle(p)
        idle(d)
    return fabric, p, d


def send(final: bool = True) -> StepMeta:
    return StepMeta(sends=[SendSpec("p1", "t1", D_ADDR, 0, P_IDS, 8, final)])


def launch(p: Side, step: StepMeta) -> None:
    """One forward's hooks as vLLM calls them: bind, each layer's save, wait_for_save."""
    p.worker.bind(step)
    for name in p.layers():
        p.worker.save_layer(name)
    p.worker.end_step()


def written(fabric: Fabric, d: Side) -> int:
    return len(fabric.writes_to(d.name))


def layer_on_d(p: Side, d: Side, layer: int) -> bool:
    name = p.layers()[layer]
    return bool(torch.equal(p.caches[name][P_IDS], d.caches[name][D_IDS]))


def dones(p: Side) -> list[int]:
    """The ``writes`` count of every DONE P sent."""
    msgs = [decode(raw) for _, raw in p.agent.sent]
    return [int(m.body["writes"]) for m in msgs if m is not None and m.kind is Kind.DONE]


def test_layer_mode_posts_no_layer_before_its_mark() -> None:
    held = HeldReadiness()
    fabric, p, d = pair(held)
    p.worker.bind(send())
    p.worker.save_layer(p.layers()[0])
    p.worker.save_layer(p.layers()[1])
    assert written(fabric, d) == 0  # layer 0 launched, not run
    held.marks[0].release()
    p.worker.save_layer(p.layers()[2])  # the next hook polls: layer 0 only
    assert written(fabric, d) == 1 and layer_on_d(p, d, 0) and not layer_on_d(p, d, 1)
    p.worker.end_step()
    p.worker.get_finished(set())
    assert written(fabric, d) == 1  # layers 1 and 2 and the step's end still held
    held.release_all()
    idle(p)
    assert written(fabric, d) == LAYERS and all(layer_on_d(p, d, i) for i in range(LAYERS))


def test_step_mode_posts_nothing_before_the_mark_after_the_forward() -> None:
    held = HeldReadiness()
    fabric, p, d = pair(held, write_per_layer=False)
    p.worker.bind(send())
    for name in p.layers():
        p.worker.save_layer(name)
    assert held.marks == []  # step mode records no mark per layer
    p.worker.end_step()
    p.worker.get_finished(set())
    assert len(held.marks) == 1 and written(fabric, d) == 0
    held.marks[0].release()
    idle(p)
    assert written(fabric, d) == LAYERS and all(layer_on_d(p, d, i) for i in range(LAYERS))


@pytest.mark.parametrize("gated", [True, False], ids=["gate", "no-gate"])
def test_d_gets_the_bytes_the_kernels_write_after_the_hook(gated: bool) -> None:
    """The "kernel" writes P's blocks after save_kv_layer returned: with the gate D gets those
    final bytes; without it (the negative control) the WRITE read the stale ones."""
    held = HeldReadiness()
    fabric, p, d = pair(held if gated else HostReadiness())
    stale = {n: t[P_IDS].clone() for n, t in p.caches.items()}
    launch(p, send())
    for i, t in enumerate(p.caches.values()):
        t[P_IDS] = float(i + 1)  # the device catches up with the launched kernels
    held.release_all()
    p.worker.get_finished(set())
    assert written(fabric, d) == LAYERS
    on_d = {n: d.caches[n][D_IDS] for n in d.caches}
    final_on_d = all(torch.equal(on_d[n], p.caches[n][P_IDS]) for n in p.caches)
    stale_on_d = all(torch.equal(on_d[n], stale[n]) for n in p.caches)
    assert (final_on_d, stale_on_d) == (gated, not gated)


def test_no_done_no_finished_send_while_a_layer_is_pending() -> None:
    held = HeldReadiness()
    fabric, p, d = pair(held)
    launch(p, send())
    p.finished.add("p1")  # vLLM finished the request: it waits for finished_sending
    assert p.worker.get_finished(p.finished)[0] == set()
    for mark in held.marks[:-2]:  # all but the last layer and the step's end
        mark.release()
    assert idle(p)[0] == set()  # the blocks stay held: the last layer is still to be read
    assert written(fabric, d) == LAYERS - 1 and dones(p) == []
    assert idle(d)[1] == set()  # D has no DONE, so it does not decode
    held.release_all()
    assert idle(p)[0] == set()  # every layer written and DONE sent: D has yet to acknowledge
    assert dones(p) == [LAYERS]
    assert idle(d)[1] == {"d1"}
    assert idle(p)[0] == {"p1"}


@pytest.mark.parametrize("how", ["d_abort", "p_fail"])
def test_nothing_is_posted_after_abort_or_fail(how: str) -> None:
    held = HeldReadiness()
    fabric, p, d = pair(held)
    launch(p, send())
    if how == "d_abort":
        forward(d, StepMeta(abort_recvs={"d1": ("t1", P_ADDR)}))
        idle(p)  # P reads D's ABORT
    else:
        p.worker.bind(StepMeta(fail_sends={"p1": ("t1", D_ADDR)}))
    held.release_all()  # the layers are ready only now
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}  # freed: nothing queued, nothing in flight
    assert written(fabric, d) == 0 and dones(p) == []


def test_a_failed_post_stops_the_layers_released_with_it() -> None:
    """Layers whose marks become ready together are posted in one go; once one post fails the
    send has sent FAIL, and none of the others is posted after it."""
    held = HeldReadiness()
    fabric, p, d = pair(held)
    launch(p, send())
    posts: list[int] = []
    real_post = p.agent.post_write

    def post_once(*args: Any) -> object:
        posts.append(len(posts))
        if len(posts) == 2:
            raise RuntimeError("NIXL refused the WRITE")
        return real_post(*args)

    p.agent.post_write = post_once  # type: ignore[method-assign,assignment]
    held.release_all()
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}
    assert posts == [0, 1] and written(fabric, d) == 1 and dones(p) == []
    assert idle(d)[2] == {"d1"}  # D got the FAIL


@pytest.mark.parametrize("saved", [[0, 2], []], ids=["one-layer-missed", "graph-replay"])
def test_layers_without_a_hook_are_written_behind_the_step_mark(saved: list[int]) -> None:
    """A forward that ran no save_kv_layer for some layers (a full CUDA graph's replay) still
    writes them, once the mark after the forward is ready; DONE counts them."""
    held = HeldReadiness()
    fabric, p, d = pair(held)
    p.worker.bind(send())
    for i in saved:
        p.worker.save_layer(p.layers()[i])
    p.worker.end_step()
    step_mark = held.marks[-1]
    for mark in held.marks[:-1]:
        mark.release()
    p.worker.get_finished(set())
    assert written(fabric, d) == len(saved) and dones(p) == []
    assert idle(d)[1] == set()
    step_mark.release()
    idle(p)
    assert written(fabric, d) == LAYERS and dones(p) == [LAYERS]
    assert all(layer_on_d(p, d, i) for i in range(LAYERS))
    assert idle(d)[1] == {"d1"}


def test_a_pending_layer_is_polled_in_the_idle_wait() -> None:
    """A step without a forward waits for the peer in short naps; a mark that becomes ready
    meanwhile is posted within that wait, not a step later."""
    held = HeldReadiness()
    fabric, p, d = pair(held)
    launch(p, send(final=False))
    p.worker.get_finished(set())
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            held.release_all()  # the device finishes during the wait

    p.worker._sleep = nap
    p.worker.bind(StepMeta())
    p.worker.end_step()
    assert written(fabric, d) == 0
    p.worker.get_finished(set())
    assert written(fabric, d) == LAYERS and len(naps) > 3


def test_a_kept_turn_is_written_only_after_its_mark() -> None:
    """D keeps a finished turn whose last token's KV an in-flight step may still be writing
    (asynchronous scheduling): P's PULL waits for the mark recorded when the keep was bound."""
    fabric, clock = Fabric(), Clock()
    held = HeldReadiness()
    d = make_side(fabric, D_ADDR, clock, readiness=held)
    p = make_side(fabric, P_ADDR, clock, fill=0.0)
    idle(d)
    d.worker.bind(
        StepMeta(keeps=[KeepSpec("d1", "t1", [5, 6, 7], 40, prefix_hashes(list(range(40))))])
    )
    p.worker.bind(StepMeta(asks={"p2": ("t1", D_ADDR)}))
    for _ in range(4):
        idle(p)
        idle(d)
    assert p.worker.take_answers() != {}
    p.worker.bind(StepMeta(recvs=[RecvSpec("p2", "t1", D_ADDR, 1, [9, 10], 6, pull=True)]))
    for _ in range(4):
        idle(p)
        assert idle(d)[0] == set()
    assert fabric.writes_to(p.name) == []  # D got the PULL, its mark is held
    (mark,) = held.marks
    mark.release()
    seen: set[str] = set()
    for _ in range(4):
        seen |= idle(p)[1]
        seen |= idle(d)[0]
    assert seen == {"p2", "d1"} and len(fabric.writes_to(p.name)) == LAYERS
    assert all(torch.equal(p.caches[n][[9, 10]], d.caches[n][[6, 7]]) for n in p.caches)


# -- the readiness itself --------------------------------------------------------------------------


def test_host_readiness_is_one_ready_mark() -> None:
    r = HostReadiness()
    assert r.mark() is r.mark() and r.mark().ready()


def test_readiness_follows_the_kv_cache_device() -> None:
    assert isinstance(readiness_for(torch.device("cpu")), HostReadiness)
    assert isinstance(readiness_for(torch.device("cuda", 0)), CudaReadiness)  # no GPU needed
    with pytest.raises(ValueError, match="meta"):
        readiness_for(torch.device("meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mark_is_ready_only_after_the_work_before_it() -> None:
    r = CudaReadiness(torch.device("cuda", 0))
    torch.cuda._sleep(2_000_000_000)  # a kernel that spins ~1 s on the current stream
    mark = r.mark()
    assert not mark.ready()
    torch.cuda.synchronize()
    assert mark.ready() and mark.ready()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_the_connector_asks_vllm_for_piecewise_cuda_graphs() -> None:
    need_module("vllm")
    from connector.connector import PipelinedPushConnector

    assert PipelinedPushConnector.requires_piecewise_for_cudagraph({}) is True
