"""Worker halves of P and D talking through the fake NIXL fabric, with real byte copies."""

from __future__ import annotations

import pytest

from connector.metadata import Kind, RecvSpec, SendSpec, StepMeta, decode
from connector.peers import LinkState
from connector.worker import Timeouts
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


def pair(
    fabric: Fabric | None = None,
    clock: Clock | None = None,
    timeouts: Timeouts | None = None,
    **d_compat: object,
) -> tuple[Fabric, Clock, Side, Side]:
    fabric = fabric or Fabric()
    clock = clock or Clock()
    p = make_side(fabric, P_ADDR, clock, timeouts=timeouts)
    d = make_side(fabric, D_ADDR, clock, fill=0.0, timeouts=timeouts, **d_compat)
    return fabric, clock, p, d


def send(req: str, first: int, ids: list[int], final: bool, tokens: int = 0) -> StepMeta:
    return StepMeta(sends=[SendSpec(req, "t1", D_ADDR, first, ids, tokens, final)])


def recv(req: str, start: int, ids: list[int]) -> StepMeta:
    return StepMeta(recvs=[RecvSpec(req, "t1", P_ADDR, start, ids, 0)])


def settle(*sides: Side, steps: int = 4) -> dict[str, set[str]]:
    """Idle steps on every side; returns what each side reported, by agent name."""
    seen: dict[str, set[str]] = {s.name: set() for s in sides}
    for _ in range(steps):
        for s in sides:
            sending, recving, _ = idle(s)
            seen[s.name] |= sending | recving
    return seen


def same_blocks(p: Side, d: Side, p_ids: list[int], d_ids: list[int]) -> bool:
    return all(torch.equal(p.caches[n][p_ids], d.caches[n][d_ids]) for n in p.caches)


def test_layers_are_written_per_chunk_and_d_completes_after_done() -> None:
    fabric, _, p, d = pair()
    assert idle(d) == (set(), set(), set())
    forward(d, recv("d1", 0, [10, 11, 12]))
    settle(p, d)  # handshake
    forward(p, send("p1", 0, [1], final=False))  # chunk 1: block 0, every layer
    assert len(fabric.writes_to(d.name)) == LAYERS
    assert idle(d)[1] == set()  # W notices seen, no DONE yet
    forward(p, send("p1", 1, [2, 3], final=True, tokens=10))
    assert len(fabric.writes_to(d.name)) == 2 * LAYERS
    _, finished, failed = idle(d)
    assert finished == {"d1"} and failed == set()
    assert same_blocks(p, d, [1, 2, 3], [10, 11, 12])
    # P reports the send only once vLLM has finished the request.
    assert idle(p)[0] == set()
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}
    stats = p.worker.stats.take()
    assert stats is not None and stats["num_writes"] == 2 * LAYERS
    assert stats["writes_per_request"] == [2 * LAYERS]


def test_kv_in_dram_posts_the_layers_once_the_forward_ends() -> None:
    """write_batch=auto with the KV cache in DRAM is step batching: nothing is posted while the
    layers compute; at the step's end every layer is (one WRITE each), same bytes on D."""
    fabric, clock = Fabric(), Clock()
    p = make_side(fabric, P_ADDR, clock, write_per_layer=None)
    d = make_side(fabric, D_ADDR, clock, fill=0.0)
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)  # handshake, REG
    p.worker.bind(send("p1", 0, [1, 2], final=True, tokens=8))
    for name in p.layers():
        p.worker.save_layer(name)
    assert fabric.writes_to(d.name) == []  # the forward runs undisturbed
    p.worker.end_step()
    assert len(fabric.writes_to(d.name)) == LAYERS
    p.worker.get_finished(p.finished)
    _, finished, failed = idle(d)
    assert finished == {"d1"} and failed == set()
    assert same_blocks(p, d, [1, 2], [10, 11])


def test_writes_before_registration_are_queued_then_merged() -> None:
    fabric, _, p, d = pair()
    forward(p, send("p1", 0, [1], final=False))
    forward(p, send("p1", 1, [2], final=True))
    assert fabric.writes_to(d.name) == []
    forward(d, recv("d1", 0, [5, 6]))
    seen = settle(p, d)
    assert len(fabric.writes_to(d.name)) == LAYERS  # one merged write per layer
    assert same_blocks(p, d, [1, 2], [5, 6])
    assert seen[d.name] == {"d1"}


def test_blocks_cached_on_d_are_not_written() -> None:
    fabric, _, p, d = pair()
    forward(d, recv("d1", 1, [7]))  # D has logical block 0 locally
    settle(p, d)
    forward(p, send("p1", 0, [1, 2], final=True))
    settle(p, d)
    (x, *_) = fabric.writes_to(d.name)
    assert len(x.local) == 1 and same_blocks(p, d, [2], [7])


def test_prefill_failure_fails_the_receive_fast() -> None:
    _, _, p, d = pair()
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    forward(p, send("p1", 0, [1], final=False))
    forward(p, StepMeta(fail_sends={"p1": ("t1", D_ADDR)}))
    _, finished, failed = idle(d)
    assert finished == failed == {"d1"}
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}
    assert p.worker.stats.take()["failures"] == {"prefill_abort": 1}  # type: ignore[index]


def test_prefill_failure_before_p_saw_the_request() -> None:
    _, _, p, d = pair()
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    forward(p, StepMeta(fail_sends={"p1": ("t1", D_ADDR)}))
    assert idle(d)[2] == {"d1"}
    assert idle(p)[0] == set()  # nothing to report: P never held blocks for it


def test_decode_abort_stops_p_and_frees_both_sides() -> None:
    fabric, _, p, d = pair()
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    forward(p, send("p1", 0, [1], final=False))
    _, finished, failed = forward(d, StepMeta(abort_recvs={"d1": ("t1", P_ADDR)}))
    assert finished == {"d1"} and failed == set()
    n = len(fabric.writes_to(d.name))
    forward(p, send("p1", 1, [2], final=True))
    assert len(fabric.writes_to(d.name)) == n  # no more writes after the abort
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}


def test_decode_abort_before_p_started_skips_all_writes() -> None:
    fabric, _, p, d = pair()
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    forward(d, StepMeta(abort_recvs={"d1": ("t1", P_ADDR)}))
    forward(p, send("p1", 0, [1], final=True))
    assert fabric.writes_to(d.name) == []
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}


def test_mismatched_peer_is_refused_on_both_sides() -> None:
    fabric, _, p, d = pair(tp_size=2)
    forward(d, recv("d1", 0, [10]))
    forward(p, send("p1", 0, [1], final=True))
    seen = settle(p, d)
    assert seen[d.name] == {"d1"}
    assert fabric.writes_to(d.name) == []
    link = d.worker.peers.get(p.name)
    # D at TP 2 with P's per-worker heads would hold twice the model's heads: not mappable.
    assert link is not None and link.state.value == "refused" and "KV heads in all" in link.reason
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}


def test_refused_receive_is_reported_failed() -> None:
    _, _, p, d = pair(block_size=8)
    forward(d, recv("d1", 0, [10]))
    seen_failed: set[str] = set()
    for _ in range(4):
        idle(p)
        seen_failed |= idle(d)[2]
    assert seen_failed == {"d1"}


def test_handshake_timeout_when_p_is_absent() -> None:
    fabric, clock = Fabric(), Clock()
    d = make_side(fabric, D_ADDR, clock, timeouts=Timeouts(handshake_s=2.0))
    forward(d, recv("d1", 0, [10]))
    assert idle(d)[1] == set()
    clock.advance(3)
    assert idle(d)[2] == {"d1"}


def test_registration_timeout_frees_p_and_tells_d() -> None:
    _, clock, p, d = pair(timeouts=Timeouts(reg_s=5))
    settle(p, d)
    forward(p, send("p1", 0, [1], final=True))
    p.finished.add("p1")
    assert idle(p)[0] == set()
    clock.advance(6)
    assert idle(p)[0] == {"p1"}
    # A registration that arrives afterwards is answered with FAIL at once.
    failed: set[str] = set(forward(d, recv("d1", 0, [10]))[2])
    for _ in range(2):
        idle(p)
        failed |= idle(d)[2]
    assert failed == {"d1"} and not d.worker._receiver.busy
    assert d.worker.stats.take()["failures"] == {"peer_fail": 1}  # type: ignore[index]


def test_receive_timeout_aborts_p() -> None:
    _, clock, p, d = pair(timeouts=Timeouts(recv_s=10))
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    clock.advance(11)
    assert idle(d)[2] == {"d1"}
    aborts = [m for _, m in d.agent.sent if decode(m).kind is Kind.ABORT]  # type: ignore[union-attr]
    assert len(aborts) == 1


def test_write_error_fails_both_sides() -> None:
    fabric, _, p, d = pair()
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    fabric.write_mode = "err"
    forward(p, send("p1", 0, [1], final=True))
    p.finished.add("p1")
    assert idle(p)[0] == {"p1"}
    assert idle(d)[2] == {"d1"}


def test_vanished_decode_times_out_stuck_writes() -> None:
    fabric, clock, p, d = pair(timeouts=Timeouts(write_s=3))
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    fabric.write_mode = "proc"
    forward(p, send("p1", 0, [1], final=True))
    fabric.kill(d.name)
    p.finished.add("p1")
    assert idle(p)[0] == set()  # WRITE still in flight: blocks stay held
    clock.advance(4)
    assert idle(p)[0] == {"p1"}


def test_p_reports_a_send_only_once_d_acknowledged_it() -> None:
    """NIXL sends a notice only while its sender progresses (``lazy_notices``: at the sender's
    next call, as with no progress thread), and P's engine stops calling NIXL once P reports
    the send. So P reports it only after D's ACK: D always gets the last W and the DONE."""
    fabric, _, p, d = pair()
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    fabric.lazy_notices = True
    forward(p, send("p1", 0, [1, 2], final=True, tokens=8))
    p.finished.add("p1")
    completed: set[str] = set()
    for _ in range(4):
        if idle(p)[0]:
            break
        completed |= idle(d)[1]
    else:
        pytest.fail("P never reported the send")
    assert completed == {"d1"}  # before P let its blocks (and its engine) go
    assert same_blocks(p, d, [1, 2], [10, 11])
    assert [m for _, m in d.agent.sent if decode(m).kind is Kind.ACK]  # type: ignore[union-attr]


def test_a_send_d_never_acknowledges_ends_after_the_write_timeout() -> None:
    fabric, clock, p, d = pair(timeouts=Timeouts(write_s=3))
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    forward(p, send("p1", 0, [1], final=True))
    fabric.kill(d.name)  # before it read P's W and DONE: no ACK will come
    p.finished.add("p1")
    assert idle(p)[0] == set()  # written, not acknowledged: the blocks stay held
    clock.advance(4)
    assert idle(p)[0] == {"p1"}
    assert p.worker.stats.take()["failures"] == {"ack_timeout": 1}  # type: ignore[index]


def test_p_repeats_its_done_until_d_acknowledges_it() -> None:
    """NIXL over TCP can hold a notice until the connection carries another (``held_paths``):
    P's last W and its DONE stay on the way to D, however often both sides step. P repeats
    its DONE every ``nudge_s`` until D's ACK: the repeat carries the held notice out."""
    fabric, clock, p, d = pair()
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    fabric.held_paths.add((p.name, d.name))
    forward(p, send("p1", 0, [1, 2], final=True, tokens=8))
    p.finished.add("p1")
    assert settle(p, d, steps=6) == {p.name: set(), d.name: set()}  # held: nothing moves
    clock.advance(1.1)
    assert idle(p)[0] == set()  # DONE again
    assert idle(d)[1] == {"d1"}
    assert idle(p)[0] == {"p1"}  # D's ACK
    assert same_blocks(p, d, [1, 2], [10, 11])
    assert d.worker.stats.take()["requests_received"] == 1  # type: ignore[index]
    assert p.worker.stats.take()["notices_repeated"] == 1  # type: ignore[index]


def test_p_repeats_its_done_while_its_writes_are_still_in_flight() -> None:
    """A WRITE over TCP may wait, like a notice, until the connection carries more: P repeats
    its DONE every ``nudge_s`` from the first, whether or not its WRITEs have completed."""
    fabric, clock, p, d = pair()
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    fabric.write_mode = "proc"
    forward(p, send("p1", 0, [1], final=True))

    def dones() -> int:
        return sum(decode(m).kind is Kind.DONE for _, m in p.agent.sent)  # type: ignore[union-attr]

    assert dones() == 1
    clock.advance(1.1)
    idle(p)
    assert dones() == 2  # the WRITEs are still in flight
    fabric.complete_all()
    p.finished.add("p1")
    assert settle(p, d) == {p.name: {"p1"}, d.name: {"d1"}}


def test_d_answers_a_repeated_done_with_its_ack_again() -> None:
    """D's ACK held on the way back: P repeats its DONE for a receive D completed and forgot;
    D answers it with the ACK again, which carries the first out, and P reports the send."""
    fabric, clock, p, d = pair()
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    fabric.held_paths.add((d.name, p.name))
    forward(p, send("p1", 0, [1], final=True))
    p.finished.add("p1")
    assert idle(d)[1] == {"d1"}
    assert settle(p, steps=4) == {p.name: set()}  # the ACK is held: P keeps the blocks
    clock.advance(1.1)
    assert idle(p)[0] == set()  # DONE again
    assert idle(d) == (set(), set(), set())  # ... answered, nothing reported twice
    assert idle(p)[0] == {"p1"}


def test_d_repeats_its_reg_until_p_has_written() -> None:
    """D's REG held on the way to P: P computed the prompt and waits for D's blocks; D
    repeats its REG every ``nudge_s`` until P's DONE, and P writes once it has one."""
    fabric, clock, p, d = pair()
    forward(d, recv("d1", 0, [10]))  # a first transfer: the link is up
    settle(p, d)
    forward(p, send("p1", 0, [1], final=True))
    p.finished.add("p1")
    settle(p, d)
    fabric.held_paths.add((d.name, p.name))
    forward(d, StepMeta(recvs=[RecvSpec("d2", "t2", P_ADDR, 0, [12, 13], 0)]))
    forward(p, StepMeta(sends=[SendSpec("p2", "t2", D_ADDR, 0, [3, 4], 8, True)]))
    p.finished.add("p2")
    assert settle(p, d, steps=6) == {p.name: set(), d.name: set()}  # no REG, no WRITE
    assert len(fabric.writes_to(d.name)) == LAYERS  # the first transfer's only
    clock.advance(1.1)
    assert idle(d)[1] == set()  # REG again
    assert idle(p)[0] == set()  # ... P writes and says DONE
    assert idle(d)[1] == {"d2"}
    assert same_blocks(p, d, [3, 4], [12, 13])
    assert len(fabric.writes_to(d.name)) == 2 * LAYERS  # a WRITE a layer: the repeat wrote none


def test_a_link_repeats_its_hello_until_the_peer_is_ready() -> None:
    """P's HELLO held on the way to D: P has D's HELLO (READY), D is still CONNECTING. D says
    HELLO again every ``nudge_s``; P answers a repeated HELLO with its own again, which
    carries the held one out, and D registers its blocks."""
    fabric, clock, p, d = pair()
    fabric.held_paths.add((p.name, d.name))
    forward(d, recv("d1", 0, [10]))
    settle(p, d)
    assert p.worker.peers.get(d.name).state is LinkState.READY  # type: ignore[union-attr]
    assert d.worker.peers.get(p.name).state is LinkState.CONNECTING  # type: ignore[union-attr]
    fabric.held_paths.clear()
    clock.advance(1.1)
    settle(d, p, steps=2)
    assert d.worker.peers.get(p.name).state is LinkState.READY  # type: ignore[union-attr]
    forward(p, send("p1", 0, [1], final=True))
    assert idle(d)[1] == {"d1"}
    assert same_blocks(p, d, [1], [10])


def test_a_write_completed_after_its_post_reaches_d_during_ps_next_forward() -> None:
    """NIXL sends a WRITE's notice when its poster checks the WRITE (unless it completed
    within its post, as UCX's CMA copies do on one host; RDMA and GPU memory complete later).
    P checks its WRITEs in every layer hook, so D learns the prompt's KV landed while P
    computes its next step (another request's prefill chunk), not a whole step later."""
    fabric, _, p, d = pair()
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    fabric.write_mode = "proc"  # the bytes move after the post
    assert forward(p, send("p1", 0, [1, 2], final=True)) == (set(), set(), set())
    fabric.complete_all()  # ... after P's get_finished checked them
    p.worker.bind(StepMeta())  # P's next step; its forward has reached the first layer
    p.worker.save_layer(p.layers()[0])
    assert idle(d)[1] == {"d1"}  # before P's next get_finished
    assert same_blocks(p, d, [1, 2], [10, 11])


def test_the_write_tail_is_the_transfer_left_after_the_prompt_s_last_step() -> None:
    """P counts from the end of the prompt's last step to its last WRITE's completion, not
    from the first WRITE (which spans every chunk): what D waits for beyond P's compute."""
    fabric, clock, p, d = pair()
    forward(d, recv("d1", 0, [10, 11, 12]))
    settle(p, d)
    forward(p, send("p1", 0, [1], final=False))  # chunk 1, written as it is computed
    clock.advance(2.0)  # chunk 2 comes two seconds later
    fabric.write_mode = "proc"
    forward(p, send("p1", 1, [2, 3], final=True, tokens=10))
    clock.advance(0.25)
    fabric.complete_all()
    p.finished.add("p1")
    assert idle(p)[0] == set()  # written: D has yet to acknowledge
    assert idle(d)[1] == {"d1"}
    assert idle(p)[0] == {"p1"}
    stats = p.worker.stats.take()
    assert stats is not None
    assert stats["write_tail_seconds"] == [pytest.approx(0.25)]
    assert stats["write_seconds"] == [pytest.approx(2.25)]


def test_a_reg_arriving_during_a_forward_is_read_by_its_layer_hooks() -> None:
    """D's REG for a prompt P has already computed, arriving while P computes another step,
    is read by that step's layer hooks: the prompt's WRITEs and DONE go out during the
    forward, not after it."""
    fabric, _, p, d = pair()
    forward(d, StepMeta(recvs=[RecvSpec("d0", "t0", P_ADDR, 0, [12], 0)]))  # the link is up
    settle(p, d)
    forward(p, send("p1", 0, [1, 2], final=True))  # computed; D has not registered t1 yet
    assert not fabric.writes_to(d.name)
    p.worker.bind(StepMeta())  # P's next step (another request's chunk) ...
    forward(d, recv("d1", 0, [10, 11]))  # ... while D registers t1
    p.worker.save_layer(p.layers()[0])
    assert fabric.writes_to(d.name)  # within P's forward
    assert idle(d)[1] == {"d1"}
    assert same_blocks(p, d, [1, 2], [10, 11])


def test_hello_is_sent_once_the_peer_becomes_reachable() -> None:
    """Regression: P checked D's HELLO while D's metadata was not yet loaded on P; P's own
    HELLO was then never sent, and D timed out its handshake."""
    fabric, _, p, d = pair()
    forward(d, recv("d1", 0, [10]))  # D reaches P and sends HELLO
    fabric.hold_metadata = True
    idle(p)  # P reads D's HELLO but cannot answer yet
    fabric.hold_metadata = False
    seen = set()
    for _ in range(3):
        idle(p)
        seen |= idle(d)[2]
    assert seen == set()
    forward(p, send("p1", 0, [1], final=True))
    assert idle(d)[1] == {"d1"}


def test_preempted_prefill_drops_stale_queued_layers() -> None:
    fabric, _, p, d = pair()
    forward(p, send("p1", 0, [1], final=False))  # queued: D has not registered yet
    forward(p, send("p1", 0, [4, 5], final=True))  # resumed with new blocks from block 0
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    sources = {desc[0] for x in fabric.writes_to(d.name) for desc in x.local}
    assert p.caches["model.layers.0.self_attn.attn"][1].data_ptr() not in sources
    assert same_blocks(p, d, [4, 5], [10, 11])


def test_finished_ids_of_other_requests_are_not_kept() -> None:
    _, _, p, _ = pair()
    p.finished.update({"plain-1", "plain-2"})
    idle(p)
    assert p.worker._sender._finished_reqs == set()


def test_idle_steps_pause_only_while_waiting_for_a_peer() -> None:
    """Empty engine steps wait briefly for the peer instead of spinning; steps with a forward
    and steps with nothing pending do not wait."""
    fabric, clock = Fabric(), Clock()
    naps: list[float] = []
    p = make_side(fabric, P_ADDR, clock)
    d = make_side(fabric, D_ADDR, clock, fill=0.0)
    d.worker._sleep = naps.append  # type: ignore[method-assign]
    idle(d)
    assert naps == []  # nothing pending
    forward(d, recv("d1", 0, [10]))
    assert naps == []  # a step with a forward
    idle(p)
    idle(d)
    assert len(naps) == 20  # 2 ms in 0.1 ms slices: P has not written yet


def test_a_decode_restarted_under_its_engine_id_is_linked_again() -> None:
    """D's worker restarts with the same engine id (the same agent name): its HELLO names a
    new incarnation, so P ends the send that holds the old D's REG (its blocks are gone:
    nothing more is written for it), releases its list of the old memory, removes the old
    agent's metadata and links afresh; the new D's transfer lands."""
    fabric, clock, p, d = pair()
    forward(d, recv("d1", 0, [10, 11]))
    settle(p, d)
    forward(p, send("p1", 0, [1], final=False))
    assert len(fabric.writes_to(d.name)) == LAYERS
    old_lists = [h for h in p.agent.prepped if h.owner == d.name]

    d2 = make_side(fabric, D_ADDR, clock, fill=0.0)  # the same name, a new agent
    assert d2.name == d.name
    forward(d2, StepMeta(recvs=[RecvSpec("d2", "t2", P_ADDR, 0, [12, 13], 0)]))
    settle(p, d2)
    assert p.agent.removed == [d.name]
    assert old_lists and all(h.released for h in old_lists)
    forward(p, send("p1", 1, [2], final=True))  # the old send: failed, writes nothing
    forward(p, StepMeta(sends=[SendSpec("p2", "t2", D_ADDR, 0, [3, 4], 8, True)]))
    _, finished, failed = idle(d2)
    assert finished == {"d2"} and failed == set()
    assert same_blocks(p, d2, [3, 4], [12, 13])
    assert all(not d2.caches[n][[10, 11]].any() for n in d2.caches)  # nothing of p1 landed
    p.finished |= {"p1", "p2"}
    assert idle(p)[0] == {"p1", "p2"}
    stats = p.worker.stats.take()
    assert stats is not None and stats["failures"] == {"peer_fail": 1}
