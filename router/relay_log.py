"""The relay's log lines (``pd_router.relay``): a request refused when its dispatch could
not open, and a D stream that broke or ended with D's own error event."""

from __future__ import annotations

import logging

from router.errors import RouterError, UpstreamError
from router.pd.opened import Dispatch

__all__ = ["log_refused", "log_stream"]

log = logging.getLogger("pd_router.relay")


def log_refused(exc: RouterError, client_id: str, model: str) -> None:
    log.warning(
        "event=refused request_id=%s client_id=%s model=%s status=%d code=%s reason=%r",
        getattr(exc, "request_id", "-"),
        client_id,
        model,
        exc.status,
        exc.code,
        exc.message,
    )


def log_stream(dispatch: Dispatch, event: str, client_id: str, err: UpstreamError | None) -> None:
    """``err`` None: D's own error event (the decode engine named); else what broke."""
    if err is None:
        log.warning(
            "event=%s request_id=%s client_id=%s role=decode engine=%s",
            event,
            dispatch.request_id,
            client_id,
            dispatch.leg.instance.key,
        )
        return
    log.warning(
        "event=%s request_id=%s client_id=%s role=%s engine=%s reason=%r cause=%r",
        event,
        dispatch.request_id,
        client_id,
        err.role,
        err.engine,
        err.message,
        str(err.__cause__ or err.code),
    )
