"""What a relay is given: the app's shared collaborators (:class:`Relaying`) and, for an
answer made of other legs than one dispatch's D, its :class:`Composer`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.errors import Outcome
from router.lifecycle import Lifecycle
from router.pd.dispatch import Dispatcher
from router.pd.relay_hooks import RelayHooks

__all__ = ["Composer", "Relaying"]


@dataclass(frozen=True, slots=True)
class Relaying:
    """What every relay of one app shares (router/context.py builds it once)."""

    dispatcher: Dispatcher
    lifecycle: Lifecycle
    clock: Callable[[], float]
    total_timeout: float


class Composer(Protocol):
    """An answer made of other legs than one dispatch's D (a migrating stream,
    router/pd/migration.py; several prompts, router/multi_prompt.py): it runs them and
    hands the relay their bytes through ``hooks``, never the client's ASGI messages."""

    @property
    def count(self) -> int:
        """Continuations on another engine after a D failed mid-stream (the access log)."""

    async def run(self, hooks: RelayHooks) -> Outcome:
        """Answer through ``hooks``; raises :class:`RouterError` only if nothing was sent."""
