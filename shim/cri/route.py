"""How weft answers one CRI method path: a handler, and when it applies.

The relay reads routes and nothing else of the verbs, so it never imports
them; the table of every route is :mod:`shim.cri.verbs.routes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Handler = Callable[[bytes, Any], bytes]  # (request bytes, context) -> response bytes
# (request bytes, context, emit) -> None: a server-streaming answer; each ``emit(message)`` sends one response
# message, and returning ends the call with OK (raising, with the error's status).
StreamHandler = Callable[[bytes, Any, Callable[[bytes], None]], None]


@dataclass(frozen=True, slots=True)
class Route:
    handle: Handler | None
    # Intercepted only while this is true; the path passes through to containerd otherwise (``None``: always).
    when: Callable[[], bool] | None = None
    # Read the request body first: weft answers only when ``pick(body)`` is true, and the call goes to
    # containerd frame by frame otherwise, as if weft were not there.
    pick: Callable[[bytes], bool] | None = None
    # A server-streaming method weft answers (``handle`` is then None): run on a thread of its own for the
    # call's life, not on the pool the unary verbs share.
    stream: StreamHandler | None = None

    def applies(self) -> bool:
        return self.when is None or self.when()
