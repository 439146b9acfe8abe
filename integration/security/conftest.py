"""The security suite: each test performs an attack on weft and checks it is refused.

``mesh`` is a real CPU host agent (cpu-1) in front of the session's
containerd, serving the mesh over mutual TLS; tests speak to it as any peer
(``integration.fuzz.mesh_fixture``) and look at what its containerd runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from integration.fuzz.mesh_fixture import MeshHost, mesh_host
from shim.localfabric.containerd import Containerd


@pytest.fixture(scope="module")
def mesh(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHost]:
    yield from mesh_host(containerd_session, tmp_path_factory.mktemp("security-mesh"))
