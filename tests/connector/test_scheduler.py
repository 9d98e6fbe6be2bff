"""Scheduler half: per-step send plans (chunked prefill), D registration, finish paths."""

from __future__ import annotations

from connector.address import NixlAddress
from connector.scheduler import SchedulerSide
from router.pd.pipelined_params import decode_params, prefill_params
from tests.connector.helpers import request, sched_output

BS = 4
P_PARAMS = prefill_params("t1", NixlAddress("decode-0", "h", 6700))
D_PARAMS = decode_params("t1", NixlAddress("prefill-0", "h", 6600))


def test_chunked_prefill_writes_each_block_once_and_the_tail_last() -> None:
    s = SchedulerSide(BS)
    req = request("p1", P_PARAMS, prompt_len=10)  # blocks: 4 + 4 + 2 tokens
    s.on_new_request(req)
    s.update_state_after_alloc(req, [], 0)
    step1 = s.build_connector_meta(sched_output(new=[("p1", [7, 8], 0, 6)]))
    assert [(x.first_block, x.block_ids, x.final) for x in step1.sends] == [(0, [7], False)]
    step2 = s.build_connector_meta(sched_output(cached=[("p1", [9], 6, 4)]))
    assert [(x.first_block, x.block_ids, x.final, x.num_tokens) for x in step2.sends] == [
        (1, [8, 9], True, 10)
    ]
    assert s.build_connector_meta(sched_output(cached=[("p1", None, 10, 1)])).sends == []


def test_prefix_cached_blocks_go_out_with_the_first_step() -> None:
    s = SchedulerSide(BS)
    req = request("p1", P_PARAMS, prompt_len=9)
    s.on_new_request(req)
    step = s.build_connector_meta(sched_output(new=[("p1", [1, 2, 3], 8, 1)]))
    assert [(x.first_block, x.block_ids, x.final) for x in step.sends] == [(0, [1, 2, 3], True)]


def test_normal_finish_holds_blocks_until_reported() -> None:
    s = SchedulerSide(BS)
    req = request("p1", P_PARAMS, prompt_len=4, status="FINISHED_LENGTH_CAPPED")
    s.on_new_request(req)
    s.build_connector_meta(sched_output(new=[("p1", [3], 0, 4)]))
    delay, params = s.request_finished(req, [3])
    assert delay and params == {"transfer_id": "t1", "transfer_mode": "pipelined"}
    assert s.has_pending_work()
    s.update_connector_output({"p1"}, set())
    assert not s.has_pending_work()


def test_prefill_abort_before_scheduling_still_notifies_d() -> None:
    s = SchedulerSide(BS)
    req = request("p1", P_PARAMS, prompt_len=8, status="FINISHED_ABORTED")
    s.on_new_request(req)
    assert s.request_finished(req, []) == (False, None)
    step = s.build_connector_meta(sched_output())
    assert step.fail_sends["p1"][0] == "t1"


def test_prefill_abort_mid_prefill_waits_for_the_worker() -> None:
    s = SchedulerSide(BS)
    req = request("p1", P_PARAMS, prompt_len=8, status="FINISHED_ABORTED")
    s.on_new_request(req)
    s.build_connector_meta(sched_output(new=[("p1", [3, 4], 0, 4)]))
    assert s.request_finished(req, [3, 4]) == (True, None)
    assert "p1" in s.build_connector_meta(sched_output()).fail_sends


def test_decode_registers_the_uncached_blocks() -> None:
    s = SchedulerSide(BS)
    req = request("d1", D_PARAMS, prompt_len=10)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 4) == (6, True)
    assert s.get_num_new_matched_tokens(req, 4) == (6, True)  # side-effect free
    s.update_state_after_alloc(req, [20, 21, 22], 6)
    assert s.get_num_new_matched_tokens(req, 10) == (0, False)
    (spec,) = s.build_connector_meta(sched_output()).recvs
    assert (spec.tid, spec.start_block, spec.block_ids) == ("t1", 1, [21, 22])
    assert spec.peer.engine_id == "prefill-0"


def test_decode_abort_while_waiting_finishes_the_receive() -> None:
    s = SchedulerSide(BS)
    req = request("d1", D_PARAMS, prompt_len=8, status="FINISHED_ABORTED")
    s.on_new_request(req)
    s.update_state_after_alloc(req, [1, 2], 8)
    s.build_connector_meta(sched_output())
    assert s.request_finished(req, [1, 2]) == (False, None)
    assert "d1" in s.build_connector_meta(sched_output()).abort_recvs


def test_decode_finished_after_transfer_is_quiet() -> None:
    s = SchedulerSide(BS)
    req = request("d1", D_PARAMS, prompt_len=8, status="FINISHED_STOPPED")
    s.on_new_request(req)
    s.update_state_after_alloc(req, [1, 2], 8)
    s.build_connector_meta(sched_output())
    s.update_connector_output(set(), {"d1"})
    assert s.request_finished(req, [1, 2]) == (False, None)
    assert s.build_connector_meta(sched_output()).is_empty()


def test_plain_and_malformed_requests_are_not_transfers() -> None:
    s = SchedulerSide(BS)
    mistyped = {**D_PARAMS, "remote_port": "6600"}  # NixlAddress.from_params wants an int
    for req in (
        request("a", None, 8),
        request("b", {"do_remote_prefill": True}, 8),
        request("c", mistyped, 8),
    ):
        s.on_new_request(req)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        assert s.request_finished(req, []) == (False, None)


def test_empty_steps_nap_only_while_a_peer_is_pending() -> None:
    naps: list[float] = []
    s = SchedulerSide(BS, idle_sleep_s=0.001, sleep=naps.append)
    empty = sched_output()
    empty.total_num_scheduled_tokens = 0
    s.build_connector_meta(empty)
    assert naps == []  # nothing pending
    req = request("d1", D_PARAMS, prompt_len=8)
    s.on_new_request(req)
    s.update_state_after_alloc(req, [1, 2], 8)
    s.build_connector_meta(empty)
    assert naps == []  # this step carries the registration
    s.build_connector_meta(empty)
    assert naps == [0.001]  # waiting for P's writes
