"""The test suite turns kvbaton's test hooks on (`test_hooks` in the connector's settings): engines
that tests start inherit this environment. A production engine never has it."""

import os

import pytest

os.environ["KVBATON_TEST_HOOKS"] = "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Mark on each item whether its test body raised (an expected failure included), for
    fixtures that act on a failure."""
    yield
    if call.when == "call":
        item.call_raised = call.excinfo is not None
