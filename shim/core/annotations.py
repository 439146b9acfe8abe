"""Parsing of the small values weft reads from its own configuration.

Kept pure so that both the agent's config loader and tests share one parser
with one set of error messages.
"""

from __future__ import annotations


def parse_host_port(value: str, *, field: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too); raise ValueError naming ``field``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{field}: expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{field}: port {port!r} in {value!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{field}: port {number} in {value!r} is out of range 0-65535")
    return host, number
