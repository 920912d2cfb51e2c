"""The restore gate (P side): a returning prefix comes back from history only when that is faster
than computing it again, by the engine's own measurements. No hand-set threshold.

Rule 1: the decision lives here, as pure arithmetic on measurements. The shell (the connector's
scheduler side) measures its engine's steps and its restores, feeds them in as samples, and asks
before it asks history for a prefix and again once history said what it holds.

Theory of operation. A prompt whose first k tokens history holds can start two ways:

* Recompute: the request is scheduled at once, with k more prompt tokens in its prefill. A step
  takes about a + b·tokens seconds on this engine (`StepFit`: a least-squares line through its own
  recent steps, older steps weighing less), so the k tokens cost b·k, plus a whole step (a + b·budget)
  for each extra chunk they add when the prompt is longer than a step's token budget.
* Restore: the request waits while history is asked, the copy runs, vLLM hears the blocks arrived
  and schedules it again. That wait is measured from the ask to the step that schedules the request
  (`RestoreFit`), as a fixed part plus copy seconds per block of each tier.

The gate restores when the predicted wait is shorter than the recompute. Until the engine has
measured enough steps and restores it restores (today's behaviour, and how restores get measured);
after `EXPLORE_EVERY` declines in a row it restores once anyway, so a wait that got shorter (a
quieter engine, a warm copy path) is noticed. An eager small-model P, whose step is mostly fixed
launch cost, then recomputes short prefixes; a large model restores them.
"""

from __future__ import annotations

import math
from enum import StrEnum

import msgspec

# Enough samples for a line through the steps, and for the restore wait.
MIN_STEPS = 16
MIN_RESTORES = 3
# Each new sample keeps this share of the weight of those before it (about 64 steps and 8
# restores of memory).
STEP_DECAY = 63 / 64
RESTORE_DECAY = 7 / 8
# After this many declines in a row, one restore is made to measure again.
EXPLORE_EVERY = 32
TIERS = ("gpu", "cpu")


class GateReason(StrEnum):
    """Why the gate chose as it did (`kvbaton_history_gate_total{choice,reason}`)."""

    UNMEASURED = "unmeasured"  # too few measurements yet: restore
    FASTER = "faster"  # restoring is predicted faster: restore
    SLOWER = "slower"  # recomputing is predicted faster: recompute
    EXPLORE = "explore"  # predicted slower, restored to measure again


class StepFit(msgspec.Struct):
    """seconds ≈ a + b·tokens over the engine's recent steps (weighted least squares)."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds >= 0.0 or math.isinf(seconds):
            return
        d = STEP_DECAY
        self.weight = self.weight * d + 1.0
        self.sum_x = self.sum_x * d + tokens
        self.sum_y = self.sum_y * d + seconds
        self.sum_xx = self.sum_xx * d + tokens * tokens
        self.sum_xy = self.sum_xy * d + tokens * seconds
        self.steps += 1

    def line(self) -> tuple[float, float]:
        """(a, b): fixed seconds per step and seconds per token, both at least 0. Steps that all
        schedule about as many tokens say nothing about the slope: then b is the mean seconds per
        token (an upper bound on the slope, so the gate errs towards restoring)."""

        if self.weight <= 0.0:
            return 0.0, 0.0
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        if var_x <= (0.1 * mean_x) ** 2:
            return 0.0, mean_y / mean_x if mean_x > 0 else 0.0
        slope = (self.sum_xy / self.weight - mean_x * mean_y) / var_x
        slope = max(0.0, slope)
        return max(0.0, mean_y - slope * mean_x), slope


class RestoreFit(msgspec.Struct):
    """A restore's wait ≈ fixed + copy seconds per block of each tier."""

    fixed_s: float = 0.0
    per_block_s: dict[str, float] = msgspec.field(default_factory=dict)
    restores: int = 0

    def add(self, wait_s: float, copy_s: float, gpu_blocks: int, cpu_blocks: int) -> None:
        if not wait_s >= 0.0 or math.isinf(wait_s) or gpu_blocks + cpu_blocks <= 0:
            return
        copy_s = min(max(0.0, copy_s), wait_s)
        d = RESTORE_DECAY if self.restores else 0.0
        self.fixed_s = self.fixed_s * d + (wait_s - copy_s) * (1 - d)
        # The copy's seconds go to the tiers in proportion to what each is believed to cost per
        # block (equally at first).
        blocks = {"gpu": gpu_blocks, "cpu": cpu_blocks}
        guess = {tier: self.per_block_s.get(tier, 1.0) * n for tier, n in blocks.items()}
        total = sum(guess.values()) or 1.0
        for tier, n in blocks.items():
            if n:
                sample = copy_s * guess[tier] / total / n
                known = tier in self.per_block_s
                self.per_block_s[tier] = self.per_block_s[tier] * RESTORE_DECAY + sample * (1 - RESTORE_DECAY) \
                    if known else sample
        self.restores += 1

    def wait(self, gpu_blocks: int, cpu_blocks: int) -> float:
        per = self.per_block_s
        fallback = max(per.values()) if per else 0.0
        return (self.fixed_s + gpu_blocks * per.get("gpu", fallback) + cpu_blocks * per.get("cpu", fallback))


class GateChoice(msgspec.Struct, frozen=True):
    restore: bool
    reason: GateReason
    restore_s: float = 0.0  # predicted wait of a restore (0: not predicted)
    recompute_s: float = 0.0  # predicted cost of computing the tokens instead

    def detail(self) -> str:
        """How the choice reads in a request's report and the logs."""

        if self.reason == GateReason.UNMEASURED:
            return str(self.reason)
        return (f"{self.reason}: restore ~{self.restore_s * 1e3:.1f} ms, recompute "
                f"~{self.recompute_s * 1e3:.1f} ms")


def recompute_seconds(steps: StepFit, tokens: int, rest_tokens: int, budget: int) -> float:
    """What computing `tokens` more prompt tokens costs a request whose prefill has `rest_tokens`
    left anyway, with `budget` tokens per step (0: unbounded): each token's share, plus the fixed
    part of every extra step the tokens take."""

    a, b = steps.line()
    extra_chunks = 0
    if budget > 0:
        extra_chunks = math.ceil((tokens + rest_tokens) / budget) - math.ceil(max(rest_tokens, 1) / budget)
    return b * tokens + max(0, extra_chunks) * a


def choose(steps: StepFit, restores: RestoreFit, declined: int, *, tokens: int, gpu_blocks: int,
           cpu_blocks: int, rest_tokens: int, budget: int, waited_s: float = 0.0) -> GateChoice:
    """Restore `gpu_blocks` + `cpu_blocks` blocks (`tokens` prompt tokens) from history, or compute
    them? `declined`: how many restores the gate declined since it last restored; `waited_s`: how
    long the request has waited for history already (that part of a restore's wait is spent)."""

    if steps.steps < MIN_STEPS or restores.restores < MIN_RESTORES:
        return GateChoice(True, GateReason.UNMEASURED)
    restore_s = max(0.0, restores.wait(gpu_blocks, cpu_blocks) - max(0.0, waited_s))
    recompute_s = recompute_seconds(steps, tokens, rest_tokens, budget)
    if restore_s < recompute_s:
        return GateChoice(True, GateReason.FASTER, restore_s, recompute_s)
    if declined >= EXPLORE_EVERY:
        return GateChoice(True, GateReason.EXPLORE, restore_s, recompute_s)
    return GateChoice(False, GateReason.SLOWER, restore_s, recompute_s)
