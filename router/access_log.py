"""Access log: one line per inference request, written when the request ends.

Lines go to the ``pd_router.access`` logger at INFO, as ``key=value`` pairs in text format
or, with ``logging.format: json``, as the record's own JSON fields (python-json-logger puts
``extra`` keys at the top level). Off by default: when off, nothing is built per request.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from router.config import LoggingConfig

ACCESS_LOGGER = "pd_router.access"


@dataclass(slots=True)
class AccessRecord:
    """What one request's line says, in this order. Times in milliseconds; ``-`` where not
    known (a request refused before its dispatch opened has no decision or engines)."""

    method: str
    path: str
    status: int
    model: str
    mode: str
    outcome: str
    duration_ms: float
    request_id: str = "-"
    client_id: str = "-"
    decision: str = "-"
    prefill: str = "-"
    decode: str = "-"
    ttft_ms: float | None = None
    priority_class: str = "-"
    migrations: int = 0  # continuations on another engine after D failed mid-stream


class AccessLog:
    """Writes :class:`AccessRecord` lines; ``enabled`` is checked before building one."""

    def __init__(self, config: LoggingConfig, logger: logging.Logger | None = None) -> None:
        self.enabled = config.access
        self._json = config.format == "json"
        self._log = logger or logging.getLogger(ACCESS_LOGGER)
        if self.enabled:
            # Asked for, so written whatever ``log_level`` says about the router's other logs.
            self._log.setLevel(logging.INFO)

    def write(self, record: AccessRecord) -> None:
        fields = asdict(record)
        fields["duration_ms"] = round(record.duration_ms, 1)
        if record.ttft_ms is not None:
            fields["ttft_ms"] = round(record.ttft_ms, 1)
        if self._json:
            self._log.info("access", extra=fields)
            return
        self._log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()))


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, config: LoggingConfig) -> None:
    """Root logging for ``pd-router serve``: text lines, or one JSON object per record
    (python-json-logger: ``time``, ``level``, ``logger``, ``message`` and any ``extra``)."""
    handler = logging.StreamHandler()
    if config.format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
