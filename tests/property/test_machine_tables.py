"""Each machine's compiled table agrees with the `transitions` library on every (state, trigger)."""

import ast
import pathlib

import pytest

from kvbaton.core import history, lease, load, ticket

SPECS = [ticket.SPEC, load.SPEC, lease.SPEC, history.SPEC]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_table_matches_transitions_declaration(spec):
    machine, _ = spec.build_transitions_machine()
    for state in spec.states:
        library_triggers = set(machine.get_triggers(state))
        table_triggers = {trigger for (source, trigger) in spec.table if source == state}
        assert library_triggers == table_triggers, state
        for trigger in spec.triggers:
            event = machine.events[trigger]
            library_dests = {t.dest if t.dest is not None else state for t in event.transitions.get(state, [])}
            table_dests = set(spec.table.get((state, trigger), ()))
            assert library_dests == table_dests, (state, trigger)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_terminal_states_have_no_exits_and_every_state_is_reachable(spec):
    for (source, _), dests in spec.table.items():
        if source in spec.terminal:
            assert spec.name == "history_block" and source == "EVICTED", (source, dests)
    reachable, frontier = {spec.initial}, [spec.initial]
    while frontier:
        state = frontier.pop()
        for (source, _), dests in spec.table.items():
            if source == state:
                for dest in dests - reachable:
                    reachable.add(dest)
                    frontier.append(dest)
    assert reachable == set(spec.states)


def test_mermaid_diagram_is_drawn_from_the_declaration():
    text = ticket.SPEC.mermaid()
    assert "stateDiagram" in text and "ISSUED --> CLAIMED: claim" in text


def test_core_imports_nothing_from_the_shell():
    core = pathlib.Path(ticket.__file__).parent
    allowed = {"msgspec", "transitions", "__future__", "typing", "collections", "heapq", "hashlib", "enum",
               "struct", "zlib", "math"}
    for path in core.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    continue  # within core
                names = [(node.module or "").split(".")[0]] if node.level == 0 else ["<parent package>"]
            else:
                continue
            for name in names:
                assert name in allowed, f"{path.name} imports {name}"
