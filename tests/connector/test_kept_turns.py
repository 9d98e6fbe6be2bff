"""Kept turns: D keeps a finished turn, the next turn's P asks, compares
block hashes, claims what matches and pulls it; every way out frees D's blocks once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from connector.address import NixlAddress
from connector.kept_turns import HASH_TOKENS, prefix_hashes, usable_tokens
from connector.metadata import KeepSpec, Kind, RecvSpec, StepMeta, decode
from connector.scheduler import SchedulerSide
from connector.worker import Timeouts
from router.pd.pipelined_params import decode_params, prefill_params
from tests.connector.helpers import (
    D_ADDR,
    LAYERS,
    P_ADDR,
    Clock,
    Side,
    idle,
    make_side,
    sched_output,
)
from tests.fakes.fake_nixl import Fabric
from tests.needs import need_module

BS = 16
OTHER_P = NixlAddress("prefill-1", "127.0.0.1", 6601)
TURN = list(range(100, 140))  # prompt and reply: 40 tokens held, in 3 blocks (16 + 16 + 8)


def kept_request(
    status: str = "FINISHED_STOPPED", computed: int = 40, keep: bool | str = True
) -> SimpleNamespace:
    """D's finished turn: 41 token ids, the last sampled one without KV yet; kept under its
    transfer id ``t1`` (``keep=True``) or under the router's keep id ``keep``."""
    return SimpleNamespace(
        request_id="d1",
        kv_transfer_params={**decode_params("t1", P_ADDR), "keep_turn": keep},
        num_prompt_tokens=30,
        status=SimpleNamespace(name=status),
        all_token_ids=[*TURN, 99],
        num_computed_tokens=computed,
    )


def next_turn(prompt: list[int], req_id: str = "p2") -> SimpleNamespace:
    reuse = {"transfer_id": "t1", **D_ADDR.as_params()}
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params={**prefill_params("t2", D_ADDR), "read_kept_turn": reuse},
        num_prompt_tokens=len(prompt),
        prompt_token_ids=prompt,
        status=SimpleNamespace(name="WAITING"),
    )


def edited(at: int, extra: int = 5) -> list[int]:
    """The kept turn with token ``at`` changed, then ``extra`` new tokens."""
    return [*TURN[:at], 0, *TURN[at + 1 :], *range(200, 200 + extra)]


# -- hashes --------------------------------------------------------------------------------------


def test_hashes_chain_so_an_early_edit_changes_every_later_span() -> None:
    held = prefix_hashes(TURN)
    assert len(held) == 3 == -(-len(TURN) // HASH_TOKENS)
    assert all(x != y for x, y in zip(held, prefix_hashes(edited(1)[:40]), strict=True))
    assert prefix_hashes(TURN[:32]) == held[:2]


def test_usable_tokens_is_the_common_prefix_and_never_the_last_token() -> None:
    held = prefix_hashes(TURN)
    assert usable_tokens([*TURN, 1, 2, 3], 40, held) == 40  # all of it, the short span too
    assert usable_tokens(TURN, 40, held) == 39  # the prompt's last token is computed
    assert usable_tokens(edited(20), 40, held) == 16  # the spans before the edit's
    assert usable_tokens(edited(0), 40, held) == 0
    assert usable_tokens(edited(38), 40, held) == 32  # a reply re-tokenised otherwise
    assert usable_tokens(TURN[:35], 40, held) == 32  # a truncated history


# -- scheduler -----------------------------------------------------------------------------------


def test_d_keeps_a_normal_finish_with_its_hashes_and_holds_the_blocks() -> None:
    s = SchedulerSide(BS)
    req = kept_request()
    s.on_new_request(req)
    s.update_state_after_alloc(req, [5, 6], 30)
    s.build_connector_meta(sched_output())
    s.update_connector_output(set(), {"d1"})
    assert s.request_finished(req, [5, 6, 7]) == (True, None)
    step = s.build_connector_meta(sched_output())
    assert step.keeps == [KeepSpec("d1", "t1", [5, 6, 7], 40, prefix_hashes(TURN))]
    # vLLM itself steps D while the blocks await the connector: nothing more is asked.
    assert not s.has_pending_work()


def test_d_keeps_under_the_routers_keep_id_and_tells_its_worker_from_admission_on() -> None:
    s = SchedulerSide(BS)
    req = kept_request(keep="keep-conv-1")
    s.on_new_request(req)
    assert s.build_connector_meta(sched_output()).expecting == ["keep-conv-1"]
    s.update_state_after_alloc(req, [5, 6], 30)
    s.build_connector_meta(sched_output())
    s.update_connector_output(set(), {"d1"})
    assert s.request_finished(req, [5, 6, 7]) == (True, None)
    step = s.build_connector_meta(sched_output())
    assert step.keeps == [KeepSpec("d1", "keep-conv-1", [5, 6, 7], 40, prefix_hashes(TURN))]
    assert step.unexpected == []


@pytest.mark.parametrize("status", ["FINISHED_ABORTED", "FINISHED_ERROR"])
def test_d_keeps_nothing_of_an_aborted_or_failed_turn(status: str) -> None:
    s = SchedulerSide(BS)
    req = kept_request(status)
    s.on_new_request(req)
    s.update_state_after_alloc(req, [5, 6], 30)
    s.update_connector_output(set(), {"d1"})
    s.build_connector_meta(sched_output())
    assert s.request_finished(req, [5, 6, 7]) == (False, None)
    step = s.build_connector_meta(sched_output())
    assert step.keeps == [] and step.unexpected == ["t1"]  # an ASK for it is refused now
    assert not s.has_pending_work()


def _asked(s: SchedulerSide, req: Any) -> StepMeta:
    s.on_new_request(req)
    return s.build_connector_meta(sched_output())


def test_p_waits_for_d_then_claims_and_pulls_only_the_blocks_past_its_own_cache() -> None:
    s = SchedulerSide(BS)
    req = next_turn([*TURN, 1, 2])
    step = _asked(s, req)
    assert step.asks == {"p2": ("t1", D_ADDR)}
    assert s.get_num_new_matched_tokens(req, 16) == (None, False)  # D has not answered
    s.on_answers({"p2": (40, prefix_hashes(TURN))})
    assert s.get_num_new_matched_tokens(req, 16) == (24, True)  # 16 cached here, 24 from D
    s.update_state_after_alloc(req, [40, 41, 42], 24)
    step = s.build_connector_meta(sched_output())
    assert step.recvs == [RecvSpec("p2", "t1", D_ADDR, 1, [41, 42], 24, pull=True)]


def test_an_edited_history_claims_only_the_span_before_the_edit_even_inside_a_block() -> None:
    s = SchedulerSide(32)  # a span is half a block
    req = next_turn(edited(20))
    _asked(s, req)
    s.on_answers({"p2": (40, prefix_hashes(TURN))})
    assert s.get_num_new_matched_tokens(req, 0) == (16, True)
    s.update_state_after_alloc(req, [40, 41], 16)
    step = s.build_connector_meta(sched_output())
    assert step.recvs == [RecvSpec("p2", "t1", D_ADDR, 0, [40], 16, pull=True)]
    req_fresh = next_turn(edited(0), "p3")
    _asked(s, req_fresh)
    s.on_answers({"p3": (40, prefix_hashes(TURN))})
    assert s.get_num_new_matched_tokens(req_fresh, 0) == (0, False)
    s.update_state_after_alloc(req_fresh, [40, 41, 42], 0)
    step = s.build_connector_meta(sched_output())
    assert step.releases == {"t1": D_ADDR} and step.recvs == []  # D frees at once


def test_no_answer_in_time_or_a_refusal_computes_everything() -> None:
    clock = Clock()
    s = SchedulerSide(BS, reuse_timeout_s=1.0, clock=clock)
    req = next_turn([*TURN, 1])
    _asked(s, req)
    clock.advance(0.5)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.6)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    other = next_turn([*TURN, 1], "p3")
    _asked(s, other)
    s.on_answers({"p3": None})
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)


def test_p_aborted_while_waiting_for_d_declines_the_kept_turn() -> None:
    s = SchedulerSide(BS)
    req = next_turn([*TURN, 1])
    _asked(s, req)
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    s.request_finished(req, [])
    step = s.build_connector_meta(sched_output())
    assert step.releases == {"t1": D_ADDR}


# -- workers -------------------------------------------------------------------------------------

torch = need_module("torch")  # real tensors below: needs the engine extra


def sides(timeouts: Timeouts | None = None) -> tuple[Fabric, Clock, Side, Side]:
    fabric, clock = Fabric(), Clock()
    d = make_side(fabric, D_ADDR, clock, timeouts=timeouts)  # random KV: the kept turn
    p = make_side(fabric, P_ADDR, clock, fill=0.0, timeouts=timeouts)
    return fabric, clock, p, d


def settle(*all_sides: Side, steps: int = 4) -> dict[str, tuple[set[str], set[str]]]:
    seen: dict[str, tuple[set[str], set[str]]] = {s.name: (set(), set()) for s in all_sides}
    for _ in range(steps):
        for s in all_sides:
            sending, recving, _ = idle(s)
            seen[s.name][0].update(sending)
            seen[s.name][1].update(recving)
    return seen


def keep(d: Side) -> None:
    idle(d)
    d.worker.bind(StepMeta(keeps=[KeepSpec("d1", "t1", [5, 6, 7], 40, prefix_hashes(TURN))]))


def ask(p: Side, req: str = "p2") -> None:
    p.worker.bind(StepMeta(asks={req: ("t1", D_ADDR)}))


def test_p_asks_d_answers_p_pulls_and_d_frees_after_its_writes() -> None:
    fabric, _, p, d = sides()
    keep(d)
    ask(p)
    settle(p, d)
    assert p.worker.take_answers() == {"p2": (40, prefix_hashes(TURN))}
    p.worker.bind(StepMeta(recvs=[RecvSpec("p2", "t1", D_ADDR, 1, [9, 10], 6, pull=True)]))
    seen = settle(p, d)
    assert seen[p.name][1] == {"p2"} and p.worker.invalid_blocks() == set()
    assert seen[d.name][0] == {"d1"}  # freed once its WRITEs completed
    assert len(fabric.writes_to(p.name)) == LAYERS  # one WRITE per layer
    assert all(torch.equal(p.caches[n][[9, 10]], d.caches[n][[6, 7]]) for n in p.caches)
    assert torch.count_nonzero(p.caches[p.layers()[0]][[8, 11]]) == 0  # nothing else written
    stats = p.worker.stats.take()
    assert stats is not None and stats["tokens_pulled"] == 6


def test_an_ask_ahead_of_the_keep_is_answered_once_it_arrives_or_refused_later() -> None:
    """The client has the answer as its last bytes go out; vLLM hands D's worker the finished
    request's plan a step or two later, so P's ASK may come first: it waits while a request
    to be kept under that id runs (up to early_ask_s)."""
    _, clock, p, d = sides()
    idle(d)
    d.worker.bind(StepMeta(expecting=["t1", "t-late"]))
    ask(p)
    settle(p, d)
    assert p.worker.take_answers() == {}  # waiting, not refused
    keep(d)
    settle(p, d)
    assert p.worker.take_answers() == {"p2": (40, prefix_hashes(TURN))}
    p.worker.bind(StepMeta(asks={"p3": ("t-late", D_ADDR)}))  # expected, never kept
    settle(p, d)
    assert p.worker.take_answers() == {}
    clock.advance(1.5)  # past early_ask_s: refused
    settle(p, d)
    assert p.worker.take_answers() == {"p3": None}
    stats = p.worker.stats.take()
    assert stats is not None and stats["kept_missed"] == 1  # p3 only: p2 was answered


def test_an_ask_for_an_id_no_running_request_keeps_is_refused_at_once() -> None:
    """A router that names a conversation's keep id without knowing whether the last turn was
    kept costs P one round trip: no wait for early_ask_s."""
    _, _, p, d = sides()
    idle(d)
    d.worker.bind(StepMeta(expecting=["t-ends-unkept"]))
    p.worker.bind(StepMeta(asks={"p3": ("t-never", D_ADDR), "p4": ("t-ends-unkept", D_ADDR)}))
    settle(p, d)
    assert p.worker.take_answers() == {"p3": None}  # refused without any clock advance
    d.worker.bind(StepMeta(unexpected=["t-ends-unkept"]))  # its request ended, not kept
    settle(p, d)
    assert p.worker.take_answers() == {"p4": None}


def test_a_newer_turn_under_the_same_keep_id_replaces_the_older_one() -> None:
    _, _, p, d = sides()
    idle(d)
    d.worker.bind(StepMeta(keeps=[KeepSpec("d1", "k", [5, 6, 7], 40, prefix_hashes(TURN))]))
    newer = [*TURN, *range(300, 308)]
    d.worker.bind(StepMeta(keeps=[KeepSpec("d2", "k", [8, 9, 10], 48, prefix_hashes(newer))]))
    assert settle(d)[d.name][0] == {"d1"}  # nobody asked for the older one: freed at once
    p.worker.bind(StepMeta(asks={"p2": ("k", D_ADDR)}))
    settle(p, d)
    assert p.worker.take_answers() == {"p2": (48, prefix_hashes(newer))}


def test_a_turn_being_read_finishes_when_a_newer_one_takes_its_id() -> None:
    fabric, _, p, d = sides()
    idle(d)
    d.worker.bind(StepMeta(keeps=[KeepSpec("d1", "k", [5, 6, 7], 40, prefix_hashes(TURN))]))
    p.worker.bind(StepMeta(asks={"p2": ("k", D_ADDR)}))
    settle(p, d)
    p.worker.take_answers()
    fabric.write_mode = "proc"  # D's WRITEs stay in flight
    p.worker.bind(StepMeta(recvs=[RecvSpec("p2", "k", D_ADDR, 1, [9, 10], 6, pull=True)]))
    settle(p, d, steps=1)
    newer = [*TURN, *range(300, 308)]
    d.worker.bind(StepMeta(keeps=[KeepSpec("d2", "k", [8, 9, 10], 48, prefix_hashes(newer))]))
    assert settle(d)[d.name][0] == set()  # the older one's WRITEs are still in flight
    fabric.complete_all()
    seen = settle(p, d)
    assert seen[d.name][0] == {"d1"} and seen[p.name][1] == {"p2"}
    assert p.worker.invalid_blocks() == set()


def test_only_the_p_that_asked_may_pull_or_abort() -> None:
    fabric = Fabric()
    clock = Clock()
    d = make_side(fabric, D_ADDR, clock)
    p = make_side(fabric, P_ADDR, clock, fill=0.0)
    other = make_side(fabric, OTHER_P, clock, fill=0.0)
    keep(d)
    ask(p)
    settle(p, d, other)
    other.worker.bind(StepMeta(recvs=[RecvSpec("x", "t1", D_ADDR, 1, [9], 6, pull=True)]))
    other.worker.bind(StepMeta(abort_recvs={"x": ("t1", D_ADDR)}))
    settle(p, d, other)
    assert fabric.writes_to(other.name) == []  # refused: it did not ask
    p.worker.bind(StepMeta(recvs=[RecvSpec("p2", "t1", D_ADDR, 1, [9, 10], 6, pull=True)]))
    seen = settle(p, d, other)
    assert seen[p.name][1] == {"p2"} and len(fabric.writes_to(p.name)) == LAYERS


def test_two_requests_of_one_p_reading_one_turn_leave_the_second_to_compute() -> None:
    _, _, p, d = sides()
    keep(d)
    p.worker.bind(StepMeta(asks={"p2": ("t1", D_ADDR)}))
    p.worker.bind(StepMeta(asks={"p3": ("t1", D_ADDR)}))
    settle(p, d)
    assert p.worker.take_answers() == {"p3": None, "p2": (40, prefix_hashes(TURN))}


def test_a_kept_turn_is_used_once() -> None:
    _, _, p, d = sides()
    keep(d)
    ask(p)
    settle(p, d)
    p.worker.take_answers()
    ask(p, "p3")
    settle(p, d)
    assert p.worker.take_answers() == {"p3": None}
    stats = p.worker.stats.take()
    assert stats is not None and stats["kept_missed"] == 1
    fails = [decode(raw) for _, raw in d.agent.sent]
    assert any(m is not None and m.kind is Kind.FAIL and m.tid == "t1" for m in fails)


def test_a_declined_turn_is_freed_at_once() -> None:
    _, _, p, d = sides()
    keep(d)
    ask(p)
    settle(p, d)
    p.worker.bind(StepMeta(releases={"t1": D_ADDR}))
    assert settle(p, d)[d.name][0] == {"d1"}


def test_a_turn_nobody_asks_for_is_freed_at_its_ttl_and_an_unpulled_one_soon_after_asking() -> None:
    _, clock, p, d = sides(Timeouts(keep_s=60.0, pull_s=5.0))
    keep(d)
    assert settle(d)[d.name][0] == set()
    clock.advance(61)
    assert settle(d)[d.name][0] == {"d1"}
    stats = d.worker.stats.take()
    assert stats is not None and stats["turns_kept"] == 1 and stats["kept_expired"] == 1
    keep(d)
    ask(p)
    settle(p, d)  # asked, then P vanishes without a PULL
    clock.advance(6)
    assert settle(d)[d.name][0] == {"d1"}


def test_a_failed_pull_is_reported_received_with_its_blocks_to_recompute() -> None:
    fabric, _, p, d = sides()
    keep(d)
    ask(p)
    settle(p, d)
    fabric.write_mode = "err"
    p.worker.bind(StepMeta(recvs=[RecvSpec("p2", "t1", D_ADDR, 1, [9, 10], 6, pull=True)]))
    seen = settle(p, d)
    assert seen[p.name][1] == {"p2"}  # finished, not failed: vLLM recomputes the blocks
    assert p.worker.invalid_blocks() == {9, 10}
    assert seen[d.name][0] == {"d1"}


def test_p_aborted_mid_pull_stops_d_and_reports_no_load_error() -> None:
    fabric, _, p, d = sides()
    keep(d)
    ask(p)
    settle(p, d)
    fabric.write_mode = "proc"  # D's WRITEs stay in flight
    p.worker.bind(StepMeta(recvs=[RecvSpec("p2", "t1", D_ADDR, 1, [9, 10], 6, pull=True)]))
    settle(p, d, steps=1)
    p.worker.bind(StepMeta(abort_recvs={"p2": ("t1", D_ADDR)}))
    seen = settle(p, d)
    assert seen[p.name][1] == {"p2"} and p.worker.invalid_blocks() == set()
    assert seen[d.name][0] == set()  # D's blocks stay until its WRITEs drain
    fabric.complete_all()
    assert settle(d)[d.name][0] == {"d1"}
