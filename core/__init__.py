"""The pure, deterministic lifecycle core: events in, effects out, no I/O, no clock, no threads.

Modules: `events` (facts), `effects` (orders to the shell), one module per machine (`ticket`,
`load`, `lease`, `history`), `ledger` (applies events), `audit` (an outside check of a ledger by
its effects), `log` (the framed event log) and `replay`.
"""

from .ledger import Ledger, LedgerConfig

__all__ = ["Ledger", "LedgerConfig"]
