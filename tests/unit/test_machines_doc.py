"""docs/reference/MACHINES.md is what scripts/machines_doc.py draws from the core today (machine
declarations, the ledger's dispatch table, the handlers' contract lines, events and effects)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "machines_doc.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("machines_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_machines_md_is_not_stale():
    gen = load_generator()
    assert gen.DOC.read_text() == gen.render(), (
        "docs/reference/MACHINES.md is stale: run `.venv/bin/python scripts/machines_doc.py`")


def test_every_event_the_ledger_answers_is_on_the_page():
    from kvbaton.core.ledger import Ledger

    gen = load_generator()
    text = gen.render()
    for event_cls in gen.dispatch_table(Ledger()):
        assert f"`{event_cls.__name__}` (`" in text
