"""One slot per request on the connector's scheduler side: everything it knows about a request,
from the first callback vLLM makes for it to `request_finished`, in one typed record.

A slot is in one `SlotState` at a time; each state is one sentence below. A decode engine's
request that arrived with a handoff moves CLAIMING → GRANTED → LOADING → DONE (or to LOCAL when the
claim is refused; LOADING straight from CLAIMING when vLLM allocates before P answers). A sibling
of an `n > 1` request (one ticket, read once) waits in SIBLING until its reader's load is over.
A prefill engine's request that asks history moves ASKED → RESERVED → RESTORING → DONE (or LOCAL
when nothing is kept). What the request computes itself and why is `reason`; what it loaded and
where its prompt came from is reported in its response (`handoff_report`, `restore_report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ...core.reasons import LoadMode


class SlotState(StrEnum):
    # A decode engine's handoff.
    CLAIMING = "claiming"  # the claim is on its way to P; P has not answered yet
    GRANTED = "granted"  # P granted the ticket; the load reads into what vLLM allocates next
    LOADING = "loading"  # vLLM allocated the blocks (maybe before P answered); the sidecar reads into them
    SIBLING = "sibling"  # shares another request's ticket (n > 1): waits for that load, then takes D's cache
    # A prefill engine's history restore.
    ASKED = "asked"  # history was asked for the prompt's prefix; no answer yet
    RESERVED = "reserved"  # history holds `blocks` blocks of the prefix under `lease`
    RESTORING = "restoring"  # vLLM allocated the blocks; history copies into them
    # Either.
    LOCAL = "local"  # nothing (more) to load: the engine computes what its cache lacks (`reason`: why)
    DONE = "done"  # the load or restore ended (`loaded`: its tokens arrived; `reason`: why not)


# A sibling's reason: it reads no handoff of its own.
SHARES_A_HANDOFF = "shares a handoff"
WAITING = frozenset({SlotState.CLAIMING, SlotState.GRANTED})  # a handoff not consumed yet
LEASED = frozenset({SlotState.ASKED, SlotState.RESERVED})  # a lease to give back if unused


@dataclass
class Slot:
    state: SlotState = SlotState.LOCAL
    reason: str = ""
    handoff: bool = False  # it arrived with a handoff section (accepted or not): no history restore
    keys: list[str] | None = None  # P: the prompt's history keys, once known in full
    # A handoff (D).
    ticket: str = ""
    control: str = ""
    epoch: int = 0
    num_tokens: int = 0  # what the request asks for, then what P granted (never more)
    local_computed: int = 0  # D's own prefix-cache hit when it allocated
    external: int = 0  # tokens the load was to deliver past that hit
    reader: Any = None  # SIBLING: the request that reads the shared ticket
    claimed_at: float = 0.0  # when the claim went to P
    warm: bool = False  # P granted it, and this engine has read from P's engine before
    mode: str = ""  # a granted load: how it runs (core.reasons.LoadMode), by the last ask
    waiting_since: float = 0.0
    # A restore (P).
    lease: str = ""
    first: int = 0  # prompt block index of the first key asked for (the local prefix-cache hit)
    asked_at: float = 0.0  # this ask (a scheduling retry asks again)
    first_asked_at: float = 0.0  # the request's first ask: the wait the restore gate measures
    blocks: int = 0  # restorable blocks, once answered
    cpu_blocks: int = 0  # of them, in the CPU tier
    loaded: bool = False  # DONE: the handoff or restore delivered its tokens
    gated: bool = False  # P: the restore gate chose to recompute what history holds (`reason`)
    gate_reason: str = ""  # P: why the restore gate chose as it did when history was asked
    session: tuple[str, float, bool] | None = None  # P: the agent session it is a turn of (id, keep s, resume)

    @property
    def sync(self) -> bool:
        """vLLM runs the load in the step that allocates its blocks (a synchronous load)."""

        return self.mode == LoadMode.IN_STEP

    def restore_report(self, prompt_tokens: int, block_size: int) -> dict:
        """Where P's prompt tokens came from: its own prefix cache, the history tiers, or
        recomputed (and why, when history was asked and did not restore)."""

        cached = min(self.first * block_size, prompt_tokens)
        restored = min(self.blocks * block_size, prompt_tokens - cached) if self.loaded else 0
        cpu = min(self.cpu_blocks * block_size, restored)
        report = {"prompt_tokens": prompt_tokens, "engine_cache": cached, "history_gpu": restored - cpu,
                  "history_cpu": cpu, "recomputed": prompt_tokens - cached - restored}
        if report["recomputed"]:
            report["recomputed_because"] = ("tail" if self.loaded else
                                            self.reason or ("miss" if not self.blocks else "not restored"))
        return report

    def handoff_report(self, prompt_tokens: int) -> dict:
        """Where a decode request's prompt tokens came from: D's own prefix cache, P's handoff, or
        recomputed, and why recomputed (the refusal, miss or failure, as it was counted)."""

        cached = min(self.local_computed, prompt_tokens)
        handed = self.external if self.loaded else 0
        report = {"prompt_tokens": prompt_tokens, "engine_cache": cached, "handoff": handed,
                  "recomputed": max(0, prompt_tokens - cached - handed)}
        if report["recomputed"]:
            # Past a delivered handoff the engine computes the rest itself (the prompt's last token,
            # and what P did not hold); otherwise the refusal, miss or failure, as it was counted.
            report["recomputed_because"] = "tail" if self.loaded else (self.reason or "miss")
        return report
