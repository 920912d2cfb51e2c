"""The restore gate (core/gate.py): a line through the engine's steps, a fit of its restores' waits,
and the choice between them."""

from __future__ import annotations

import pytest

from kvbaton.core import gate
from kvbaton.core.gate import GateReason, RestoreFit, StepFit, choose


def fitted_steps(fixed_s: float, per_token_s: float, tokens=(16, 64, 256, 512, 1024, 2048)) -> StepFit:
    steps = StepFit()
    for _ in range(8):
        for n in tokens:
            steps.add(n, fixed_s + per_token_s * n)
    return steps


def fitted_restores(wait_s: float, copy_s: float, blocks: int, cpu: bool = False) -> RestoreFit:
    restores = RestoreFit()
    for _ in range(gate.MIN_RESTORES):
        restores.add(wait_s, copy_s, 0 if cpu else blocks, blocks if cpu else 0)
    return restores


def test_the_step_line_recovers_fixed_and_per_token_seconds():
    a, b = fitted_steps(0.010, 2e-5).line()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(2e-5, rel=1e-6)


def test_steps_all_of_one_size_give_the_mean_per_token_cost():
    a, b = fitted_steps(0.010, 2e-5, tokens=(512,)).line()
    assert a == 0.0 and b == pytest.approx((0.010 + 2e-5 * 512) / 512)


def test_newer_steps_outweigh_older_ones():
    steps = fitted_steps(0.010, 1e-4)
    for _ in range(100):
        for n in (16, 256, 1024):
            steps.add(n, 0.010 + 1e-5 * n)  # the engine got faster per token
    assert steps.line()[1] == pytest.approx(1e-5, rel=0.25)


def test_a_restore_wait_splits_into_fixed_and_per_block_copy_by_tier():
    restores = RestoreFit()
    restores.add(0.030, 0.004, 8, 0)
    restores.add(0.040, 0.016, 0, 8)
    assert restores.fixed_s < 0.030 and restores.per_block_s["cpu"] > restores.per_block_s["gpu"] > 0
    assert restores.wait(0, 8) > restores.wait(8, 0)


def test_unmeasured_restores():
    assert choose(StepFit(), RestoreFit(), 0, tokens=512, gpu_blocks=32, cpu_blocks=0, rest_tokens=1,
                  budget=0) == gate.GateChoice(True, GateReason.UNMEASURED)


@pytest.mark.parametrize("per_token_s, restores", [(1e-6, False), (1e-4, True)])
def test_restore_only_when_its_wait_beats_the_recompute(per_token_s, restores):
    """A fixed-cost engine (an eager small model: 1 µs a token) recomputes 512 tokens in 0.5 ms,
    faster than a 20 ms restore wait; at 100 µs a token the same tokens cost 51 ms."""

    choice = choose(fitted_steps(0.010, per_token_s), fitted_restores(0.020, 0.002, 32), 0, tokens=512,
                    gpu_blocks=32, cpu_blocks=0, rest_tokens=16, budget=0)
    assert choice.restore is restores
    assert choice.reason == (GateReason.FASTER if restores else GateReason.SLOWER)
    assert choice.restore_s == pytest.approx(0.020) and choice.recompute_s == pytest.approx(per_token_s * 512)


def test_tokens_past_the_step_budget_cost_whole_steps():
    steps = fitted_steps(0.010, 1e-6)
    inside = gate.recompute_seconds(steps, 512, 16, budget=2048)
    past = gate.recompute_seconds(steps, 4096, 16, budget=2048)
    assert inside == pytest.approx(512e-6, rel=1e-3)
    assert past == pytest.approx(4096e-6 + 2 * 0.010, rel=1e-3)  # two more steps' fixed part


def test_what_a_request_already_waited_for_history_is_spent():
    steps, restores = fitted_steps(0.010, 2e-5), fitted_restores(0.020, 0.002, 32)
    args = dict(tokens=512, gpu_blocks=32, cpu_blocks=0, rest_tokens=16, budget=0)
    assert not choose(steps, restores, 0, **args).restore  # 20 ms against 10.2 ms
    late = choose(steps, restores, 0, waited_s=0.015, **args)  # 5 ms left of it
    assert late.restore and late.restore_s == pytest.approx(0.005)


def test_after_enough_declines_one_restore_measures_again():
    steps, restores = fitted_steps(0.010, 1e-6), fitted_restores(0.020, 0.002, 32)
    args = dict(tokens=512, gpu_blocks=32, cpu_blocks=0, rest_tokens=16, budget=0)
    assert not choose(steps, restores, gate.EXPLORE_EVERY - 1, **args).restore
    explore = choose(steps, restores, gate.EXPLORE_EVERY, **args)
    assert explore.restore and explore.reason == GateReason.EXPLORE


def test_nonsense_samples_are_ignored():
    steps, restores = StepFit(), RestoreFit()
    steps.add(0, 1.0)
    steps.add(16, float("nan"))
    steps.add(16, float("inf"))
    restores.add(-1.0, 0.0, 1, 0)
    restores.add(0.1, 0.0, 0, 0)
    assert steps.steps == 0 and restores.restores == 0
