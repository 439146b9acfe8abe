"""Structured logging: structlog, one JSON object per line, stable event names.

Event names are dotted and stable (``agent.started``, ``cri.call``,
``upstream.unavailable``) so that tests and log pipelines match on them, not on
prose. Filtering happens before any formatting, so a debug event on a hot path
costs a method call when debug is off.

The last ``RECENT_MAX`` warnings and errors are also kept in memory
(``recent()``), for ``weft status`` to show what went wrong lately without
reading the journal.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from typing import Any

import structlog

RECENT_MAX = 50
_RECENT: deque[dict[str, Any]] = deque(maxlen=RECENT_MAX)
_RECENT_LOCK = threading.Lock()
_RECENT_FIELD_CHARS = 300
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", stream=None) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _remember,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(logger_name=name)


def _add_name(logger: object, method: str, event: dict) -> dict:
    name = event.pop("logger_name", None)
    if name:
        event["logger"] = name
    return event


def _remember(logger: object, method: str, event: dict) -> dict:
    """Keep a bounded copy of each warning and error, values as short strings (never a live object)."""
    if event.get("level") in ("warning", "error", "critical"):
        kept = {k: v if isinstance(v, int | float | bool) or v is None else str(v)[:_RECENT_FIELD_CHARS]
                for k, v in event.items() if k != "exception"}
        with _RECENT_LOCK:
            _RECENT.append(kept)
    return event


def recent() -> list[dict[str, Any]]:
    """The latest warnings and errors this process logged, oldest first."""
    with _RECENT_LOCK:
        return list(_RECENT)
