"""Machines declared once as data, checked cheaply on the hot path.

Each machine module declares its states and transitions as a list of dicts in the shape the
`transitions` library takes (`trigger`, `source`, `dest`). `MachineSpec` compiles that list into a
plain `{(state, trigger): dests}` table: a dict lookup is about 0.2 µs where a `transitions`
trigger costs 11–30 µs. The `transitions` machine itself is built only for tests (which prove the
table and the library agree on every pair) and for `kvbaton replay --diagram`.
"""

from __future__ import annotations

from collections.abc import Iterable


class MachineSpec:
    """A state machine as data: states, terminal states, and the allowed moves."""

    def __init__(
        self,
        name: str,
        states: Iterable[str],
        initial: str,
        terminal: Iterable[str],
        transitions: list[dict],
    ) -> None:
        self.name = name
        self.states = tuple(states)
        self.initial = initial
        self.terminal = frozenset(terminal)
        self.transitions = transitions
        table: dict[tuple[str, str], frozenset[str]] = {}
        for move in transitions:
            sources = move["source"] if isinstance(move["source"], list) else [move["source"]]
            for source in sources:
                key = (source, move["trigger"])
                dest = source if move["dest"] == "=" else move["dest"]  # "=": stay (transitions' reflexive)
                table[key] = table.get(key, frozenset()) | {dest}
        unknown = {s for pair in table for s in (pair[0],)} | {d for ds in table.values() for d in ds}
        unknown -= set(self.states)
        if unknown:
            raise ValueError(f"machine {name}: transitions name unknown states {sorted(unknown)}")
        self.table = table
        self.triggers = tuple(sorted({move["trigger"] for move in transitions}))

    def allows(self, state: str, trigger: str) -> bool:
        return (state, trigger) in self.table

    def allows_move(self, state: str, trigger: str, dest: str) -> bool:
        dests = self.table.get((state, trigger))
        return dests is not None and dest in dests

    def build_transitions_machine(self, graph: bool = False):
        """The same machine as a `transitions` object (tests and diagrams only: it is slow)."""

        if graph:
            from transitions.extensions.diagrams import GraphMachine as Machine

            extra = {"graph_engine": "mermaid"}
        else:
            from transitions import Machine

            extra = {}

        class Model:
            pass

        model = Model()
        machine = Machine(
            model=model,
            states=list(self.states),
            transitions=[dict(move) for move in self.transitions],
            initial=self.initial,
            auto_transitions=False,
            **extra,
        )
        return machine, model

    def mermaid(self) -> str:
        """A mermaid state diagram drawn by `transitions` from the declaration."""

        machine, model = self.build_transitions_machine(graph=True)
        return str(model.get_graph().draw(None))
