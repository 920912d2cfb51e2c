"""An independent auditor: checks a ledger from the outside, by its events and effects alone.

The ledger's own `check_invariants` looks at its state; a ledger with a bug can keep a state that
looks consistent while it forgets to return blocks or grants what it must refuse. The auditor keeps
its own books from the event stream and the effects the ledger emitted, so such bugs show up as:

* blocks returned twice, or returned for a ticket never issued (double free);
* a read granted on blocks already returned (use after return);
* blocks returned while a granted read is still in flight (unless its reader had been silent on
  the ticket for `reader_silence_ns`: then a `Tick` may end its reads);
* a release or read accepted from someone who is not the current claimer;
* a read's end answered "held" for a read that was not in flight (ended, or never granted);
* at quiescence (`leaks()`), tickets whose blocks were never returned, loads never finished,
  leases never ended.
"""

from __future__ import annotations

from . import effects as fx
from . import events as ev


class Auditor:
    def __init__(self, reader_silence_ns: int = 0) -> None:
        self.reader_silence_ns = reader_silence_ns
        self.now = 0
        self.heard: dict[str, int] = {}  # ticket -> when its claimer last spoke on it (accepted)
        self.held: dict[str, tuple[str, int]] = {}  # ticket -> (request, block count) not returned
        self.returned: set[str] = set()
        self.reads: dict[str, set[str]] = {}  # ticket -> granted reads not yet finished
        self.owner: dict[str, tuple[str, int]] = {}  # ticket -> granted (claimer, epoch)
        self.open_loads: set[str] = set()
        self.open_leases: set[str] = set()
        self.violations: list[str] = []

    def _flag(self, seq: int, text: str) -> None:
        self.violations.append(f"event {seq}: {text}")

    def observe(self, seq: int, event: ev.Event, effects: list[fx.Effect]) -> list[str]:
        """Record one applied event and its effects; return the violations it revealed."""

        before = len(self.violations)
        rejected = any(type(e) is fx.Rejected for e in effects)
        kind = type(event)
        # Whether the read a ReadFinished ends was still in flight (before a Tick or it ends it).
        in_flight = kind is ev.ReadFinished and event.read in self.reads.get(event.ticket, ())
        self.now = max(self.now, event.at_ns)
        if kind in _CLAIMER_WORDS and not rejected:
            self.heard[event.ticket] = self.now
        elif kind is ev.Tick and self.reader_silence_ns > 0:
            # Reads whose reader was silent this long may end now, without its word.
            for ticket, reads in self.reads.items():
                if reads and self.now - self.heard.get(ticket, 0) >= self.reader_silence_ns:
                    reads.clear()
        if kind in (ev.TicketIssued, ev.RetainRequested) and not rejected:
            if event.ticket in self.held or event.ticket in self.returned:
                self._flag(seq, f"ticket {event.ticket} issued twice")
            self.held[event.ticket] = (event.request, len(event.blocks))
            self.reads[event.ticket] = set()
        elif kind is ev.ReadFinished and not rejected:
            self.reads.get(event.ticket, set()).discard(event.read)
        elif kind is ev.ReleaseRequested and not rejected:
            if self.owner.get(event.ticket) != (event.claimer, event.epoch):
                self._flag(seq, f"ticket {event.ticket}: release accepted from {event.claimer}"
                                f"#{event.epoch}, not the claimer {self.owner.get(event.ticket)}")
        elif kind is ev.LoadRequested and not rejected:
            self.open_loads.add(event.request)
        for effect in effects:
            etype = type(effect)
            if etype is fx.ReplyClaim and effect.granted:
                current = self.owner.get(effect.ticket)
                if current is not None and current != (effect.claimer, effect.epoch):
                    self._flag(seq, f"ticket {effect.ticket}: granted to {effect.claimer}#{effect.epoch}"
                                    f" while {current} holds it")
                if effect.ticket not in self.held:
                    self._flag(seq, f"ticket {effect.ticket}: claim granted on returned blocks")
                self.owner[effect.ticket] = (effect.claimer, effect.epoch)
            elif etype is fx.ReplyRead and effect.granted:
                if effect.ticket not in self.held:
                    self._flag(seq, f"ticket {effect.ticket}: read granted on returned blocks")
                if self.owner.get(effect.ticket, ("", -1))[0] != effect.claimer:
                    self._flag(seq, f"ticket {effect.ticket}: read granted to {effect.claimer},"
                                    " not the claimer")
                self.reads.setdefault(effect.ticket, set()).add(effect.read)
            elif etype is fx.ReplyReadEnd and effect.held and not in_flight:
                self._flag(seq, f"ticket {effect.ticket}: read {effect.read} answered held, but it was "
                                f"not in flight")
            elif etype is fx.FreeEngineBlocks:
                if effect.ticket in self.returned:
                    self._flag(seq, f"ticket {effect.ticket}: blocks returned twice")
                elif effect.ticket not in self.held:
                    self._flag(seq, f"ticket {effect.ticket}: returned blocks it never held")
                if self.reads.get(effect.ticket):
                    self._flag(seq, f"ticket {effect.ticket}: blocks returned with reads in flight "
                                    f"{sorted(self.reads[effect.ticket])}")
                self.held.pop(effect.ticket, None)
                self.heard.pop(effect.ticket, None)
                self.reads.pop(effect.ticket, None)  # a Tick looks at open tickets only
                self.returned.add(effect.ticket)
            elif etype is fx.LoadFinished:
                if effect.request not in self.open_loads:
                    self._flag(seq, f"load {effect.request}: finished twice or never requested")
                self.open_loads.discard(effect.request)
            elif etype is fx.ReplyRestore and effect.keys:
                self.open_leases.add(effect.lease)
            elif etype is fx.LeaseDone:
                if effect.lease not in self.open_leases:
                    self._flag(seq, f"lease {effect.lease}: ended twice or never reserved")
                self.open_leases.discard(effect.lease)
        return self.violations[before:]

    def cross_check(self, seq: int, ledger) -> list[str]:
        """Tickets the ledger closed while the auditor saw no `FreeEngineBlocks` for them."""

        found = []
        tickets = ledger.tickets.tickets
        for ticket in self.held:
            record = tickets.get(ticket)
            if record is not None and record.state == "CLOSED":
                found.append(f"event {seq}: ticket {ticket} closed without returning its blocks")
        return found

    def leaks(self) -> list[str]:
        """What is still held: call after a drain, when nothing should be."""

        found = [f"ticket {t} (request {r}): {n} blocks never returned" for t, (r, n) in sorted(self.held.items())]
        found += [f"load {r}: never finished" for r in sorted(self.open_loads)]
        found += [f"lease {ls}: never ended" for ls in sorted(self.open_leases)]
        return found


# Events by which a ticket's claimer speaks on it.
_CLAIMER_WORDS = (ev.ClaimRequested, ev.HeartbeatReceived, ev.ReadStarted, ev.ReadFinished,
                  ev.ReleaseRequested)
