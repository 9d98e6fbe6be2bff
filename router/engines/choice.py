"""The seam through which a request's own choice of engine reaches instance selection.

A :data:`Chooser` is made per request (cache-aware routing makes one from the request's token
ids: ``router/kvindex/route.py``) and carried in the request's
:class:`~router.engines.selection.Selection` to :func:`~router.engines.selection.select`
(for P and D alike). Called with a role and that role's candidates (never empty: those
the request may go to now, with a free slot for decode), it returns one of them, or None to
leave the choice to the pool's usual rule (session affinity, else the policy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.engines.instance import Instance, Role

__all__ = ["Chooser"]

Chooser = Callable[[Role, Sequence[Instance]], Instance | None]
