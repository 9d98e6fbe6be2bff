"""Engine instances set up as a test needs them, through the methods their owners use."""

from __future__ import annotations

from router.engines.instance import Instance


def hold_slots(inst: Instance, n: int) -> None:
    """Make this process hold ``n`` decode slots on ``inst``, as the ledger's reservations
    would (a policy or placement test's load)."""
    while inst.slots_held < n:
        inst.take_slot()
    while inst.slots_held > n:
        inst.give_slot()
