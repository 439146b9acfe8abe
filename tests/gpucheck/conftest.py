"""The fake libcuda, built once per session."""

from __future__ import annotations

import pytest

from tests.gpucheck import fakecuda


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fakecuda.build(tmp_path_factory.mktemp("fake-libcuda"))
