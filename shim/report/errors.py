"""The errors ``weft report`` raises on purpose; the CLI prints each as one line and exits 2.

They sit under :class:`shim.errors.WeftError` (a report is not a CRI call, so
the gRPC code they inherit is never used)::

    WeftError
    └── ReportError                 anything the report cannot do; the message says what to change
        ├── UsageError              a flag or the workload is malformed, or flags conflict
        ├── UnknownWorkload         Prometheus knows no pod of the workload in the time asked
        ├── NoOptInRecord           no record of when the workload opted in: give the windows
        └── PrometheusError         the Prometheus HTTP API failed (down, slow, or answered an error)
"""

from __future__ import annotations

from shim.errors import WeftError


class ReportError(WeftError):
    """``weft report`` cannot go on; the message names what to change."""


class UsageError(ReportError):
    """A flag, a time, a selector or a combination of flags cannot be used."""


class UnknownWorkload(ReportError):
    """No pod of the workload shows in Prometheus in the time searched."""


class NoOptInRecord(ReportError):
    """Neither weft's metrics nor its state directory say when the workload opted in."""


class PrometheusError(ReportError):
    """The Prometheus server could not be reached in time or answered with an error."""
