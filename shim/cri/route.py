"""How weft answers one CRI method path: a handler, and when it applies.

The relay reads routes and nothing else of the verbs, so it never imports
them; the table of every route is :mod:`shim.cri.verbs.routes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Handler = Callable[[bytes, Any], bytes]  # (request bytes, context) -> response bytes


@dataclass(frozen=True, slots=True)
class Route:
    handle: Handler
    # Intercepted only while this is true; the path passes through to containerd otherwise (``None``: always).
    when: Callable[[], bool] | None = None
    # Read the request body first: weft answers only when ``pick(body)`` is true, and the call goes to
    # containerd frame by frame otherwise, as if weft were not there.
    pick: Callable[[bytes], bool] | None = None

    def applies(self) -> bool:
        return self.when is None or self.when()
