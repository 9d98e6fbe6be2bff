"""One request's choice of engine: what it depends on (:class:`Selection`) and the one rule
that makes it (:func:`select`), used by the registry for P and by the slot ledger for D.

The order is fixed: the request's own chooser (cache-aware routing, ``choice.py``) if it
picks one; else, with a session key, the session's affinity (``affinity.py``); else the
pool's policy (``policies.py``), which reads the routing key. Instances in ``avoid`` are
passed over while any other candidate is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.engines.affinity import Affinity, Placement
from router.engines.choice import Chooser
from router.engines.instance import Instance, Role
from router.engines.policies import Policy

__all__ = ["Selection", "select"]


@dataclass(frozen=True, slots=True)
class Selection:
    """What a request's choice of engine depends on, the same for P and D.

    ``routing_key``: the prompt's stable start, for the ``prefix_hash`` policy (None: not
    built, the policy needs none). ``session``: the session affinity key (None: affinity
    off or no key). ``api_key_name``: the name of the API key the request came with (the
    decode queue's fair share; "" without authentication). ``avoid``: engines a retry
    keeps away from while others can serve. ``chooser``: the request's own choice (None:
    the pool's rule)."""

    routing_key: str | None = None
    session: str | None = None
    api_key_name: str = ""
    avoid: frozenset[Instance] = frozenset()
    chooser: Chooser | None = None


def select(
    role: Role,
    candidates: Sequence[Instance],
    selection: Selection,
    policy: Policy,
    affinity: Affinity | None = None,
) -> tuple[Instance, Placement | None]:
    """The instance of ``role`` for ``selection`` among ``candidates`` (never empty), and
    how affinity placed it (None: affinity did not choose). See the module doc for the
    order."""
    preferred = [i for i in candidates if i not in selection.avoid] or list(candidates)
    chooser = selection.chooser
    chosen = chooser(role, preferred) if chooser is not None else None
    if chosen is not None:
        return chosen, None
    if selection.session is not None and affinity is not None:
        return affinity.select(role, selection.session, preferred)
    return policy.select(preferred, selection.routing_key), None
