"""Machines declared once as data, checked cheaply on the hot path, and the books that run them.

Each machine module declares its states and transitions as a list of dicts in the shape the
`transitions` library takes (`trigger`, `source`, `dest`). `MachineSpec` compiles that list into a
plain `{(state, trigger): dests}` table, because `apply` runs on the engine's hot path and a dict
lookup costs a small fraction of a `transitions` trigger. The `transitions` machine itself is built
only for tests (which prove the table and the library agree on every pair) and for
`kvbaton replay --diagram`.

The table checks moves rather than choosing them: some triggers have several declared targets
(a read ending in DRAINING may stay, retain or close), and the handler picks one by the record's
data. `Book` is what the ticket, load, lease and history books share around that check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from .common import NEVER, Counters, Deadlines


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


class InternalError(RuntimeError):
    """A bug in a machine (an undeclared move, a count gone negative), raised at once in strict
    mode (`Ledger(strict=True)`: tests and simulators); an engine records it instead."""


class Book:
    """What every machine's book shares: its records by id, declared moves, deadlines, the hook
    that tells the ledger a record ended, internal errors, and the invariants every machine keeps.

    A subclass names its machine (`spec`), what it calls a record (`noun`, and `key`, the record's
    id field), its kind in the shared deadline queue, and which open states must have a deadline
    (`timed`) or must not (`untimed`: reads in flight pin memory, so they cannot expire). Its
    handlers change a record's state only through `_move`, so an undeclared move is refused and
    recorded instead of happening, and every move can be counted (`track_moves`).
    """

    spec: MachineSpec
    # Tests and simulators: an internal error raises `InternalError` where it happens, instead of
    # being recorded for the next invariant check (an engine must never raise for one).
    strict = False
    noun = "record"
    key = "id"
    kind = -1  # no deadlines
    timed: frozenset[str] = frozenset()
    untimed: frozenset[str] = frozenset()

    on_closed = staticmethod(lambda ident: None)  # the ledger's hook: a record just ended

    def __init__(self, config, counters: Counters, deadlines: Deadlines | None = None) -> None:
        self.config = config
        self.counters = counters
        self.deadlines = deadlines
        self.records: dict = {}
        self.internal_errors: list[str] = []
        # (source, trigger, dest) -> times moved; None (the default) keeps the hot path bare.
        self.moves: Counter | None = None

    def track_moves(self, into: Counter | None = None) -> Counter:
        """Count every move from now on, into `into` when given (books of many ledgers can share
        one counter): the simulator's transition coverage."""

        if into is not None:
            self.moves = into
        elif self.moves is None:
            self.moves = Counter()
        return self.moves

    # -- moves -----------------------------------------------------------------------------------

    def _move(self, record, trigger: str, dest: str) -> None:
        # A real check, not an assert: an undeclared move is a bug we record and refuse.
        source = record.state
        dests = self.spec.table.get((source, trigger))
        if dests is None or dest not in dests:
            self._internal_error(f"{self.noun} {getattr(record, self.key)}: undeclared move {source} -{trigger}-> {dest}")
            return
        if self.moves is not None:
            self.moves[(source, trigger, dest)] += 1
        record.state = dest

    def _internal_error(self, text: str) -> None:
        if self.strict:
            raise InternalError(text)
        self.internal_errors.append(text)

    def _terminate(self, record, trigger: str, dest: str) -> None:
        """Move into a terminal state: no deadline from now on, and the ledger hears of it."""

        self._move(record, trigger, dest)
        self.on_closed(getattr(record, self.key))
        record.deadline_ns = NEVER

    # -- deadlines -------------------------------------------------------------------------------

    def _set_deadline(self, record, deadline_ns: int) -> None:
        record.deadline_ns = deadline_ns
        self.deadlines.push(deadline_ns, self.kind, getattr(record, self.key))

    # Each book's `expire_due(ident, deadline_ns, now, out)` is called by `Tick` for every queue
    # entry that fell due; it first drops a stale entry (the record ended, or its deadline moved).


    # -- invariants ------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        found = list(self.internal_errors)
        spec, noun, key = self.spec, self.noun, self.key
        for record in self.records.values():
            where = f"{noun} {getattr(record, key)} ({record.state})"
            if record.state not in spec.states:
                found.append(f"{where}: unknown state")
                continue
            self._check(record, where, found)
        return found

    def _check(self, record, where: str, found: list[str]) -> None:
        """Append what is wrong with one record in a declared state (subclasses add their own)."""

        state, deadline = record.state, record.deadline_ns
        if state in self.spec.terminal:
            if deadline < NEVER:
                found.append(f"{where}: terminal with a deadline")
        elif state in self.timed:
            if deadline >= NEVER:
                found.append(f"{where}: no deadline")
        elif state in self.untimed and deadline < NEVER:
            found.append(f"{where}: a reading {self.noun} can expire")

    def open_count(self) -> int:
        terminal = self.spec.terminal
        return sum(1 for record in self.records.values() if record.state not in terminal)
