"""docs/RESULTS.md is what bench/results.py renders from the committed result files, and the
parity rule holds."""

from __future__ import annotations

from kvbaton.bench import results


def test_results_md_is_generated_from_the_result_files():
    assert results.DOC.read_text() == results.render(), (
        "docs/RESULTS.md is stale: run `python -m kvbaton.bench.results`")


def test_rounds_that_reach_one_are_parity_whatever_the_median():
    assert results.verdict(results.spread([0.61, 0.85, 1.02]), "lower") == "parity"
    assert results.verdict(results.spread([1.75, 4.02]), "higher") == "better"
    assert results.verdict(results.spread([1.14, 1.35]), "lower") == "worse"
    assert results.verdict(results.spread([1.38]), "higher") == "one round"


def test_a_target_is_met_only_when_every_round_meets_it():
    assert results.status(results.spread([1.61, 1.80, 1.82]), [">=", 1.05], "higher", "ratio") == "met"
    assert results.status(results.spread([1.0, 1.1, 1.2]), [">=", 1.05], "higher", "ratio") == "not settled"
    assert results.status(results.spread([0.9, 1.0]), [">=", 1.05], "higher", "ratio") == "not met"
    assert results.status(results.spread([0.9, 1.04]), ["no worse"], "lower", "ratio") == "met"
    assert results.status(results.spread([1.03]), [">=", 1.05], "higher", "ratio") == "one round: misses"
