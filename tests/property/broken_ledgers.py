"""Deliberately broken ledgers: the fuzzer must catch each one (it has teeth)."""


from kvbaton.core.common import NEVER
from kvbaton.core.ledger import Ledger
from kvbaton.core.ticket import CLAIMED, CLOSED, READING, TicketBook


class ForgetfulTicketBook(TicketBook):
    """Expiry of a claimed ticket closes it but forgets to return its blocks."""

    def expire_due(self, ident, deadline_ns, now, out):
        t = self.tickets.get(ident)
        if t is not None and t.deadline_ns == deadline_ns and t.state == CLAIMED:
            t.state, t.close_reason, t.returned, t.deadline_ns = CLOSED, "expired", True, NEVER
            return
        super().expire_due(ident, deadline_ns, now, out)


class ExpiresWhileReadingTicketBook(TicketBook):
    """A read does not stop the idle lease: a ticket can expire with a read in flight."""

    def read_start(self, e, now):
        out = super().read_start(e, now)
        t = self.tickets.get(e.ticket)
        if t is not None and t.state == READING:
            self._set_deadline(t, now + self.config.claim_lease_ns)
        return out

    def expire_due(self, ident, deadline_ns, now, out):
        t = self.tickets.get(ident)
        if t is not None and t.deadline_ns == deadline_ns and t.state == READING:
            t.reads.clear()
            t.state = CLAIMED
        super().expire_due(ident, deadline_ns, now, out)


class StaleClaimerTicketBook(TicketBook):
    """A release is accepted from whoever sends it, not only the current claimer and epoch."""

    def release(self, e, now):
        t = self.tickets.get(e.ticket)
        if t is not None and t.state in (CLAIMED, READING):
            e = type(e)(at_ns=e.at_ns, ticket=e.ticket, claimer=t.claimer, epoch=t.epoch)
        return super().release(e, now)


def _ledger_with(book_class):
    class BrokenLedger(Ledger):
        def __init__(self, config=None):
            super().__init__(config)
            book = book_class(self.config, self.deadlines, self.counters, self.history)
            self.tickets = book
            for event_type, handler in list(self._handlers.items()):
                name = getattr(handler, "__name__", "")
                if getattr(handler, "__self__", None).__class__.__name__ == "TicketBook" or isinstance(
                        getattr(handler, "__self__", None), TicketBook):
                    self._handlers[event_type] = getattr(book, name)
            self._expirers[0] = book.expire_due
            self._books[0] = book.tickets
            book.on_closed = lambda ident: self._record_closed(0, ident)

    BrokenLedger.__name__ = book_class.__name__.replace("TicketBook", "Ledger")
    return BrokenLedger


ForgetfulLedger = _ledger_with(ForgetfulTicketBook)
ExpiresWhileReadingLedger = _ledger_with(ExpiresWhileReadingTicketBook)
StaleClaimerLedger = _ledger_with(StaleClaimerTicketBook)
BROKEN = [ForgetfulLedger, ExpiresWhileReadingLedger, StaleClaimerLedger]
