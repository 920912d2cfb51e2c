"""The test suite turns kvbaton's test hooks on (`test_hooks` in the connector's settings): engines
that tests start inherit this environment. A production engine never has it."""

import os

os.environ["KVBATON_TEST_HOOKS"] = "1"
