"""router.deadline.Deadline keeps asyncio.timeout's contract: its own expiry leaves the block
as TimeoutError, any other cancellation passes through, and a running deadline can be moved."""

from __future__ import annotations

import asyncio

import pytest

from router.deadline import Deadline

FAR = 60.0  # a deadline no test reaches


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_the_deadline_ends_the_block_as_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError) as caught, Deadline(0.05):
        await _forever()
    assert loop.time() - started >= 0.049  # (the loop may run a timer a tick early)
    assert isinstance(caught.value.__cause__, asyncio.CancelledError)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # its cancellation was taken back


async def test_a_block_that_ends_in_time_is_left_alone() -> None:
    with Deadline(FAR):
        await asyncio.sleep(0)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_another_cancellation_passes_through() -> None:
    entered = asyncio.Event()

    async def body() -> None:
        with Deadline(FAR):
            entered.set()
            await _forever()

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_from_elsewhere_wins_over_an_expiry_at_the_same_time() -> None:
    entered = asyncio.Event()
    deadline = Deadline(FAR)

    async def body() -> None:
        with deadline:
            entered.set()
            await _forever()

    task = asyncio.create_task(body())
    await entered.wait()
    deadline.reschedule(asyncio.get_running_loop().time())  # expires at the next turn
    task.cancel()  # and the task is cancelled by someone else too
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_rescheduled_to_now_it_expires_at_once() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError), Deadline(FAR) as deadline:
        deadline.reschedule(loop.time())
        await _forever()
    assert loop.time() - started < FAR / 2


async def test_it_cannot_be_moved_once_over_nor_entered_twice() -> None:
    deadline = Deadline(FAR)
    with pytest.raises(RuntimeError):
        deadline.reschedule(0.0)  # not running yet
    with deadline:
        pass
    with pytest.raises(RuntimeError):
        deadline.reschedule(0.0)
    with pytest.raises(RuntimeError):
        deadline.__enter__()


def test_it_needs_a_running_task() -> None:
    with pytest.raises(RuntimeError):
        Deadline(FAR).__enter__()
