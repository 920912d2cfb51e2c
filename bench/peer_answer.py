"""What freshness checks cost P's sidecar on the path every handoff takes.

    python bench/peer_answer.py [--rounds 7] [--handoffs 2000] [--out FILE]

P's sidecar (the production `Sidecar`, its IO a list) answers one handoff's peer calls as they
arrive from D: claim, read start, read end with release, each a sealed frame decoded, checked for
freshness and address (the replay window), applied to the ledger and answered. Three systems in
interleaved rounds: `fresh` (as shipped), `fresh-b` (the same again: the A/A spread) and
`unchecked` (the replay window's check replaced here, in the bench, by one that accepts every
call, which is what a sidecar did before calls carried sender, instance, time and nonce). The
figure is microseconds per call; the ratio `fresh / unchecked` is the check's share of the
answer path. A round trip on loopback adds xoscar's framing and the network on top of both.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvbaton.control import peer as pc
from kvbaton.core import events as ev
from kvbaton.core.ledger import LedgerConfig
from kvbaton.testing.fake_io import listed_sidecar

SYSTEMS = ("fresh", "fresh-b", "unchecked")


def answer_path(system: str, handoffs: int) -> float:
    """Microseconds per peer call P's sidecar answers (claim, read start, read end)."""

    sidecar = listed_sidecar(Path(tempfile.mkdtemp()), "P0", "producer", LedgerConfig(closed_retention_ns=1))
    if system == "unchecked":
        sidecar.server.replay_window.refusal = lambda envelope, instance, now_ns: None
    tickets = [f"t{i:031x}" for i in range(handoffs)]
    sidecar.on_message(pc_apply(tickets))
    frames = []
    for i, ticket in enumerate(tickets):  # sealed as D seals them, each with its own nonce
        for call in (pc.Claim(ticket, "D0", 1), pc.ReadStart(ticket, "D0", 1, f"r{i}/0"),
                     pc.ReadEnd(ticket, "D0", 1, f"r{i}/0", True, True)):
            frames.append(pc.seal(call, sidecar.instance, "D0"))
    answer = sidecar.server.answer_frame
    gc.collect()
    gc.disable()  # a collection inside one system's timing is noise, not its cost
    try:
        start = time.perf_counter()
        for frame in frames:
            answer(frame)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    refused = sum(sidecar.refused.values())
    if refused or sidecar.ledger.counters.get("tickets.closed.released", 0) != handoffs:
        raise SystemExit(f"{system}: {refused} calls refused, {sidecar.ledger.counters}")
    return elapsed / len(frames) * 1e6


def pc_apply(tickets):
    from kvbaton.control import messages as m

    return m.Apply(tuple(ev.TicketIssued(0, ticket, f"req{i}", (2 * i, 2 * i + 1), (), 32, "d" * 32)
                         for i, ticket in enumerate(tickets)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--handoffs", type=int, default=2000)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    series: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    answer_path("fresh", 200)  # warm up imports and caches
    for round_ in range(args.rounds):
        order = SYSTEMS[round_ % 3:] + SYSTEMS[:round_ % 3]  # each system first in turn
        for system in order:
            series[system].append(answer_path(system, args.handoffs))
        print(f"round {round_ + 1}: " + ", ".join(f"{s} {series[s][-1]:.1f} us" for s in SYSTEMS), flush=True)

    def ratio(num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(series[num], series[den])]

    for label, values in (("fresh / unchecked", ratio("fresh", "unchecked")),
                          ("fresh-b / fresh (A/A)", ratio("fresh-b", "fresh"))):
        print(f"{label}: {statistics.median(values):.3f}x [{min(values):.3f}, {max(values):.3f}]")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        Path(args.out).write_text(json.dumps({
            "commit": commit, "date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU",
            "hardware": "2 CPU cores; P's sidecar in process (its IO a list), msgspec frames, no network",
            "command": f"python bench/peer_answer.py --rounds {args.rounds} --handoffs {args.handoffs}",
            "extracted_from": "", "figures": {"call_us": series}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
