"""docs/RESULTS.md from the committed benchmark result files: one row per target.

    python -m kvbaton.bench.results           # rewrite docs/RESULTS.md
    python -m kvbaton.bench.results --check   # exit 1 when docs/RESULTS.md differs from the files

`bench/results/targets.json` names, for each target, the result file and figure that answer it.
A result file is either `pd_compare`'s JSON (its `summary`, median/min/max over interleaved
rounds, each ratio taken within a round against that round's baseline) or a figures file
(`{"commit", "date", "machine", "hardware", "command", "figures": {figure: {system: [one value
per round]}}}`, optionally `"extracted_from"`: the result files its figures were read from).
Each run is shown with its commit, date, hardware, command and result file: from the file, or
for pd_compare files the commit from the file and the rest from `targets.json`'s `runs`.

The parity rule: a ratio whose rounds disagree by more than the gap it claims (its [min, max]
over the rounds reaches 1.0 or beyond) is parity, whatever its median. One round gives no verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "RESULTS.md"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def verdict(ratio: dict, better: str) -> str:
    """better/worse by the median's distance from 1.0, or parity when the rounds reach 1.0 or
    the distance is inside the run's A/A noise (`noise`, where the run measured it)."""

    if ratio["n"] < 2:
        return "one round"
    if ratio["min"] <= 1.0 <= ratio["max"] or abs(ratio["median"] - 1.0) <= ratio.get("noise", 0.0):
        return "parity"
    up = ratio["median"] > 1.0
    return "better" if up == (better == "higher") else "worse"


def status(fig: dict, goal: list | None, better: str, kind: str) -> str:
    """Whether the target is met: every round meets it (met), the median misses it (not met),
    or only some rounds meet it (not settled). "no worse" is met by parity or better."""

    if not goal:
        return ""
    if goal[0] == "no worse":
        v = verdict(fig, better)
        if v == "one round":
            worse = fig["median"] > 1.0 if better == "lower" else fig["median"] < 1.0
            return "one round: " + ("misses" if worse else "meets")
        return "met" if v in ("better", "parity") else "not met"
    op, bound = goal
    ok = (lambda x: x >= bound) if op == ">=" else (lambda x: x <= bound)
    if fig["n"] < 2:
        return "one round: " + ("meets" if ok(fig["median"]) else "misses")
    if ok(fig["min"]) and ok(fig["max"]):
        return "met"
    if not ok(fig["median"]):
        return "not met"
    return "not settled"


def load_figure(row: dict, runs: dict) -> tuple[dict, dict, str]:
    """(the figure as median/min/max/n, the run it comes from, "ratio" or "value")."""

    data = json.loads((RESULTS / row["file"]).read_text())
    if "figures" in data:  # a figures file
        series = data["figures"][row["figure"]]
        run = {k: data[k] for k in ("commit", "date", "machine", "hardware", "command")}
        if "extracted_from" in data:
            run["extracted_from"] = data["extracted_from"]
        if row.get("value"):  # one system's own figure, per round
            return spread(series[row["system"]]), run, "value"
        if "series" in row:
            return dict(series[row["series"]]), run, "ratio"
        num, den = series[row["num"]], series[row["den"]]
        return spread([a / b for a, b in zip(num, den)]), run, "ratio"
    run = dict(runs[row["file"]])
    commits = ({data["meta"]["commit"]} if "meta" in data
               else {f["commit"] for f in data.get("files", ())})
    run["commit"] = ", ".join(sorted(commits))
    entry = data["summary"]["systems"][row["system"]][row["figure"]]
    if row.get("value"):
        return dict(entry["value"]), run, "value"
    return {k: entry["ratio"][k] for k in ("median", "min", "max", "n", "noise") if k in entry["ratio"]}, run, "ratio"


def number(x: float, kind: str = "value") -> str:
    if kind == "ratio":
        return f"{x:.2f}" if abs(x) >= 10 else f"{x:.3f}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"


def figure_text(fig: dict, kind: str, unit: str) -> str:
    mark = "x" if kind == "ratio" else (" " + unit if unit else "")
    text = f"**{number(fig['median'], kind)}{mark}**"
    if fig["n"] > 1:
        text += f" [{number(fig['min'], kind)}, {number(fig['max'], kind)}], {fig['n']} rounds"
    else:
        text += ", 1 round"
    return text


def table(rows: list[dict], runs: dict, used: dict, with_status: bool) -> list[str]:
    head = "| target | measured | figure | verdict |" + (" status |" if with_status else "") + \
        " commit | date | machine | run |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        cells = [row["target"], row["what"]]
        if "missing" in row:
            cells += ["not measured", "", ] + (["not measured"] if with_status else []) + \
                ["", "", "", row["missing"]]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        fig, run, kind = load_figure(row, runs)
        key = used.setdefault(row["file"], (f"R{len(used) + 1}", run))[0]
        v = verdict(fig, row["better"]) if kind == "ratio" else ""
        cells += [figure_text(fig, kind, row.get("unit", "")), v]
        if with_status:
            cells.append(status(fig, row.get("goal"), row["better"], kind))
        cells += [f"`{run['commit']}`", run["date"], run["machine"], f"[{key}](#{key.lower()})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render() -> str:
    manifest = json.loads((RESULTS / "targets.json").read_text())
    runs = manifest["runs"]
    used: dict[str, str] = {}
    out = [
        "# Results",
        "",
        "<!-- Generated by `python -m kvbaton.bench.results` from bench/results/; do not edit. -->",
        "",
        "One row per figure. Every figure is the median over the rounds of one run, with its [min, max];",
        "a ratio is kvbaton's figure over the baseline's (the system the row names: `native-xlayer` is",
        "vLLM's NixlConnector with cross-layer blocks, `native-offload` NixlConnector with vLLM's CPU",
        "OffloadingConnector on P), taken within each round against that round's own baseline. A ratio whose rounds",
        "disagree by more than the gap it claims (its [min, max] reaches 1.0) is **parity**, whatever",
        "its median. A target is *met* when every round meets it, *not settled* when only the median",
        "does; a figure from one round is not evidence either way. The run column points to the",
        "run's commit, hardware, command and result file below; a command runs at its run's commit.",
        "",
        "## Targets",
        "",
    ]
    out += table(manifest["targets"], runs, used, with_status=True)
    out += ["", "## Other figures", ""]
    out += table(manifest["other"], runs, used, with_status=False)
    if manifest.get("notes"):  # one line each, under the figures they explain
        out += [""] + manifest["notes"]
    out += ["", "## Runs", ""]
    for file, (key, run) in used.items():
        source = f", read from {run['extracted_from']}" if run.get("extracted_from") else ""
        out += [f"### {key}", "",
                f"- Commit `{run['commit']}`, {run['date']}.",
                f"- Hardware: {run['hardware']}.",
                f"- Command: `{run['command']}`",
                f"- Result file: `bench/results/{file}`{source}.",
                ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with docs/RESULTS.md")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if DOC.read_text() != text:
            print("docs/RESULTS.md is stale: run python -m kvbaton.bench.results", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
