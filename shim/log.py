"""Structured logging: structlog, one JSON object per line, stable event names.

Event names are dotted and stable (``agent.started``, ``cri.call``,
``upstream.unavailable``) so that tests and log pipelines match on them, not on
prose. Filtering happens before any formatting, so a debug event on a hot path
costs a method call when debug is off.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", stream=None) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
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
