"""The engines' API key in tests: `kvbaton serve` gives its engines a random one that only the
router holds; tests that talk to an engine directly (a reference output, a handoff by hand) use
this one, set before any deployment starts (`KVBATON_ENGINE_API_KEY`, which `kvbaton serve`
processes started by the tests inherit)."""

from __future__ import annotations

import os

os.environ.setdefault("KVBATON_ENGINE_API_KEY", "kvbaton-test-engine-key-4f1c9a7e2b6d8035")
ENGINE_KEY = os.environ["KVBATON_ENGINE_API_KEY"]
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}


def handoff_params() -> dict:
    """What the router asks P for: a handoff, with the router's capability (P started by
    `kvbaton serve` hands off only those), for tests that act as the router."""

    import time

    from kvbaton.control.guard import resolve_secret
    from kvbaton.control.router_door import handoff_capability, router_key

    key = router_key(resolve_secret("", "127.0.0.1"))
    return {"do_remote_decode": True, "kvbaton_router": handoff_capability(key, time.time())}
