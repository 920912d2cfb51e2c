"""Typed reasons: the words logs and peers carry stay the same, and the shell never matches words."""

import ast
import pathlib

import msgspec
import pytest

from kvbaton.core import effects as fx
from kvbaton.core.ledger import Ledger
from kvbaton.core.reasons import Closed, Dropped, LeaseOutcome, LoadOutcome, Reason

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_members_are_their_words_on_the_wire_and_in_counters():
    assert Reason.UNKNOWN_TICKET == "unknown ticket" and {"not the claimer": 1}[Reason.NOT_CLAIMER] == 1
    rejected = fx.Rejected("cr", "t", Reason.CLAIMED_BY_ANOTHER)
    assert msgspec.msgpack.encode(rejected) == msgspec.msgpack.encode(fx.Rejected("cr", "t", "claimed by another"))
    assert "tickets.closed." + Closed.EXPIRED == "tickets.closed.expired"
    assert Reason.CLOSED.detail(Closed.EXPIRED) == "closed: expired"
    assert type(Reason.CLOSED.detail(Closed.EXPIRED)) is str
    assert LoadOutcome.CLAIM_REFUSED.detail(Reason.UNKNOWN_TICKET) == "claim refused: unknown ticket"
    assert Reason.head("closed: expired") is Reason.CLOSED
    assert Reason.head("invalid: no blocks") is Reason.INVALID
    assert Reason.head("source restarted: an earlier instance") is Reason.SOURCE_RESTARTED
    assert Reason.head("engine on fire: no such reason") is None


@pytest.mark.parametrize("enum", [Reason, Closed, LoadOutcome, LeaseOutcome, Dropped])
def test_values_are_unique(enum):
    values = [member.value for member in enum]
    assert len(values) == len(set(values))


def test_a_refusal_is_counted_under_its_reason_without_detail():
    from kvbaton.core import events as ev

    ledger = Ledger()
    ledger.apply(ev.TicketIssued(at_ns=1, ticket="t", request="r", blocks=(1,)))
    ledger.apply(ev.AbandonRequested(at_ns=2, ticket="t"))
    effects = ledger.apply(ev.ClaimRequested(at_ns=3, ticket="t", claimer="D", epoch=1))
    refused = [e for e in effects if type(e) is fx.Rejected]
    assert refused[0].reason == "closed: abandoned" and Reason.head(refused[0].reason) is Reason.CLOSED
    assert ledger.counters["rejected.closed"] == 1


def _reason_literal_comparisons(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names_reason = any(isinstance(s, ast.Attribute) and s.attr == "reason" for s in sides)
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str) and s.value for s in sides)
            if names_reason and literal:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_shell_compares_reasons_to_members_not_words():
    shell = [*ROOT.glob("control/*.py"), *ROOT.glob("adapters/vllm/*.py"), *ROOT.glob("router/*.py"),
             *ROOT.glob("sim/*.py")]
    found = [hit for path in shell for hit in _reason_literal_comparisons(path)]
    assert found == []
