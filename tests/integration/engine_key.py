"""The engines' API key in tests: `kvbaton serve` gives its engines a random one that only the
router holds; tests that talk to an engine directly (a reference output, a handoff by hand) use
this one, set before any deployment starts (`KVBATON_ENGINE_API_KEY`, which `kvbaton serve`
processes started by the tests inherit)."""

from __future__ import annotations

import os

os.environ.setdefault("KVBATON_ENGINE_API_KEY", "kvbaton-test-engine-key-4f1c9a7e2b6d8035")
ENGINE_KEY = os.environ["KVBATON_ENGINE_API_KEY"]
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}
