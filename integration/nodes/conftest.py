"""Each test's outcome where its fixtures can read it: a day-two test that failed half way is cleaned up after,
so the next test on the module's cluster starts from the state it expects, and fails only for its own reasons."""

from __future__ import annotations

import pytest

OUTCOME = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[OUTCOME] = report
    return report
