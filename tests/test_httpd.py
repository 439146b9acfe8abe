import json
import urllib.error
import urllib.request

import pytest

from shim.httpd import HttpEndpoint
from shim.metrics import Metrics


def _get(endpoint: HttpEndpoint, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{endpoint.address}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(("dead", "status"), [([], 200), (["tunnel"], 503)], ids=["all-loops-run", "a-loop-died"])
def test_healthz_says_when_an_accept_loop_died(dead: list[str], status: int) -> None:
    endpoint = HttpEndpoint("127.0.0.1:0", Metrics(), lambda: (True, "ok"), lambda: dead)
    endpoint.start()
    try:
        code, body = _get(endpoint, "/healthz")
    finally:
        endpoint.stop()
    assert code == status
    expected = {"serving": True, "containerd": "reachable", "detail": "ok"}
    assert body == ({**expected, "dead": dead} if dead else expected)
